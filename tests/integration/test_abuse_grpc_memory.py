"""Large refused gRPC requests must not hold memory (issue 19, item 8).

Five 64 MiB requests that the server refuses (unknown content, no session) used to take the server's
RSS from ~0.3 GB to over 1 GB and keep it there for minutes.  Here the server's RSS is read from
/proc/<pid>/status before and after a series of them and printed; the assert is a generous bound.
"""

from __future__ import annotations

import grpc
import pytest

from drafter.wire import pbwire
from tests.integration.conftest import SERVER_SETTINGS
from tests.support.engines import tiny_dirs
from tests.support.servers import DrafterServer

MiB = 1024 * 1024


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _big_refused_request(size: int) -> bytes:
    """One unknown length-delimited top-level field of `size` bytes: a protobuf parser accepts it, the
    drafter refuses it (no session, no tensors)."""
    return pbwire._varint_bytes(99 << 3 | 2) + pbwire._varint_bytes(size) + b"\x01" * size


@pytest.fixture(scope="module")
def server(tiny_root, tmp_path_factory, one_torch_thread):
    _, model = tiny_dirs(tiny_root, "eagle3")
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with DrafterServer(model, "eagle3", log_path=log, kv_blocks=64, block_sizes=16, **SERVER_SETTINGS) as s:
        yield s


def test_refused_large_grpc_requests_do_not_hold_memory(server):
    raw = _big_refused_request(64 * MiB)
    pid = server.proc.pid
    with grpc.insecure_channel(server.grpc_target, options=[("grpc.max_send_message_length", 512 * MiB)]) as ch:
        propose = ch.unary_unary("/drafter.v1.Drafter/Propose", lambda b: b, lambda b: b)
        info = ch.unary_unary("/drafter.v1.Drafter/Info", lambda b: b, lambda b: b)
        info(b"", timeout=30)
        before = rss_mib(pid)
        peaks = []
        for _ in range(5):
            with pytest.raises(grpc.RpcError) as e:
                propose(raw, timeout=60)
            assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
            info(b"", timeout=30)  # the server answers the next call; its memory is read after it
            peaks.append(rss_mib(pid))
    print(f"server RSS before {before:.0f} MiB, after each 64 MiB refusal: {[round(p) for p in peaks]} MiB")
    assert peaks[-1] - before < 160, "refused requests must not keep their memory"
