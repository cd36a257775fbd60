"""Closing the gRPC stream client leaves nothing pending on its private event loop (issue 20, item 7).

grpc.aio keeps a task per call waiting for its status; stopping the loop before such a task ended
made Python print "Task was destroyed but it is pending!" (after gRPC load-test runs, after a broken
stream in the demo).  The straggler here stands in for it: a task of the client's loop still
waiting when close() begins.
"""

from __future__ import annotations

import asyncio
import gc
import logging

from coordinator.transport import GrpcDrafterClient
from tests.integration.conftest import K, MML, SESSION_BLOCKS
from tests.support.scenario import Scenario
from tests.support.servers import layout_for


def test_closing_a_stream_leaves_no_task_pending(eagle3_server, caplog):
    client = GrpcDrafterClient(eagle3_server.grpc_target, timeout_s=30)
    info = client.info()
    client.attach(layout_for(info, SESSION_BLOCKS))
    s = Scenario(block_sizes=(16,), num_blocks=(SESSION_BLOCKS,), vocab_size=info.limits.vocab_size,
                 hidden_width=info.limits.hidden_width, k=K, max_model_len=MML, seed=4)
    s.add_request(0)
    stream = client.stream()
    assert stream.propose(**s.call([(0, 8, 0)]).kwargs).draft_token_ids.shape == (1, K)

    async def straggler():
        return asyncio.ensure_future(asyncio.Event().wait())  # never set: waits until cancelled
    waiting = stream._run(straggler())
    loop = stream._loop
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        stream.close()
        client.detach()
        client.close()
        gc.collect()  # a task destroyed pending is reported when it is collected
    assert waiting.cancelled()
    assert [t for t in asyncio.all_tasks(loop) if not t.done()] == []
    assert "Task was destroyed but it is pending" not in caplog.text
