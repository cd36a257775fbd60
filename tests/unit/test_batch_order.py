"""The engine thread's order after a batch (issue 23): each reply's bookkeeping reaches the event
loop before any pre-draft runs, so a connection is re-armed (and a call arriving meanwhile read)
while the engine pre-drafts, not after."""

from __future__ import annotations

import asyncio
import threading

import torch

from drafter.service.batching.queue import Batcher, EngineThread
from drafter.wire.records import Caller
from tests.support.requests import request


class _PreDrafts:
    """after_batch waits (bounded) for the batch's completion to have run in the event loop."""

    def __init__(self, delivered: threading.Event):
        self.delivered = delivered
        self.saw_delivery: list[bool] = []

    def after_batch(self, items, results) -> None:
        self.saw_delivery.append(self.delivered.wait(10.0))


class _Runner:
    max_batch, max_tokens = 4, 64

    def __init__(self, predrafts):
        self.defer_records = False
        self.predrafts = predrafts

    def run_batch(self, items):
        return [it.call.request_id for it in items]

    def flush_records(self):
        pass


def test_replies_are_delivered_before_the_pre_draft_runs():
    delivered = threading.Event()
    predrafts = _PreDrafts(delivered)
    runner, engine = _Runner(predrafts), EngineThread("test-engine")

    async def main():
        batcher = Batcher(runner, engine, window_s=0.0)
        batcher.start()
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_done(result):  # runs in this loop: what the ZMQ server's bookkeeping does
            delivered.set()
            done.set_result(result)

        call = request({"next_token_ids": torch.zeros(1, dtype=torch.int64), "target_token_ids": torch.zeros(1)},
                       "s", 0, 7)
        call.caller = Caller(connection="c")
        batcher.submit_nowait(None, call, on_done)
        result = await done
        await loop.run_in_executor(engine, lambda: None)  # after the batch's after_batch returned
        await batcher.stop()
        return result

    assert asyncio.run(main()) == 7
    engine.shutdown()
    assert predrafts.saw_delivery == [True], "the pre-draft ran before the reply's bookkeeping was delivered"
