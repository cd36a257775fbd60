"""The first propose of a process must be as fast as the rest (issue 19, item 7): it used to open the
per-step gRPC stream (a new channel: TCP and HTTP/2 set-up) inside the call and overrun a 50 ms deadline.
Now the client's transport modules are imported with it and attach opens and connects the stream."""

from __future__ import annotations

import subprocess
import sys

import grpc

from coordinator.routing import Endpoint
from coordinator.session import KVGroupSpec, SessionSpec
from tests.support.servers import REPO


def _spec(info, blocks: int = 4) -> SessionSpec:
    limits = info.limits
    return SessionSpec(method=info.method, num_speculative_tokens=info.num_speculative_tokens,
                       hidden_size=info.hidden_size, num_aux_layers=info.num_aux_layers,
                       max_model_len=limits.max_model_len, max_num_seqs=limits.max_num_seqs,
                       max_num_batched_tokens=limits.max_num_batched_tokens,
                       kv_groups=tuple(KVGroupSpec(g.block_size, blocks) for g in limits.kv_groups),
                       client="warmup-test")


def test_transport_modules_are_imported_with_the_client():
    code = ("import sys, coordinator.clients; "
            "print(all(m in sys.modules for m in ('coordinator.transport.grpc_client', "
            "'coordinator.transport.zmq_client')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "True"


def test_attach_opens_and_connects_the_step_stream(eagle3_server):
    from coordinator.clients import ServiceTransport

    port = int(eagle3_server.grpc_target.rsplit(":", 1)[1])
    t = ServiceTransport(Endpoint("grpc", "127.0.0.1", port), timeout_s=10)
    try:
        info = t.client.info()
        session = t.attach(_spec(info), timeout=10)
        stream = t._stream
        assert stream is not None and stream._call is not None, "attach must open the per-step stream"

        async def state():
            return stream._channel.get_state(try_to_connect=False)
        assert stream._run(state(), 10) == grpc.ChannelConnectivity.READY
        t.detach(session, timeout=10)
    finally:
        t.close()
