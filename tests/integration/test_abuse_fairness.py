"""One client flooding must not push another's latency (issue 19, item 4).

A ZMQ peer sends valid Propose messages on its own session without reading a reply (the issue saw
7,000 such requests push another client's p99 from 9.5 ms to 1.13 s) for as long as a well-behaved
client drafts.  Asserted: every call of the good client
succeeds with the drafts of its solo engine, and the flooder gets RESOURCE_EXHAUSTED naming
--max-inflight-per-client for what it sends beyond the cap (at once, never queued).  Printed, not
asserted (no timing asserts): the good client's p99 step unloaded and under the flood.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import time

import msgspec
import numpy as np
import pytest
import torch
import zmq

from coordinator.transport import ZmqDrafterClient
from drafter.wire import schema
from drafter.wire.errors import Code
from tests.integration.conftest import SERVER_SETTINGS, SESSION_BLOCKS, reference_engine
from tests.integration.test_service_parity import plans, scenario
from tests.support import flood
from tests.support.engines import tiny_dirs
from tests.support.requests import to_frames, to_raw
from tests.support.servers import REPO, DrafterServer, layout_for

CAP = 8  # --max-inflight-per-client
FLOOD = 100_000  # most messages the flooder sends: it floods until the good client is done
ROUNDS = 3  # sessions the good client runs through every plan, per phase
_ENC = msgspec.msgpack.Encoder()


@pytest.fixture(scope="module")
def server(tiny_root, tmp_path_factory, one_torch_thread):
    _, model = tiny_dirs(tiny_root, "eagle3")
    log = tmp_path_factory.mktemp("logs") / "fairness-server.log"
    with DrafterServer(model, "eagle3", log_path=log, kv_blocks=4 * SESSION_BLOCKS, block_sizes=16,
                       batch_window_us=500, max_inflight_per_client=CAP, **SERVER_SETTINGS) as s:
        yield s


class _Flooder:
    """tests/support/flood.py in its own process (its busy loop must not hold this process's interpreter
    lock against the good client): valid Propose messages on its own session, replies unread."""

    def __init__(self, server, tiny_root):
        argv, env = flood.command(server.zmq_endpoint, tiny_root, "--most", str(FLOOD), "--ready-after",
                                  str(4 * CAP), "--stop-on-stdin")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, env=env,
                                     text=True)

    def flooding(self) -> None:
        line = self.proc.stdout.readline()
        assert json.loads(line)["event"] == "flooding", line

    def stop(self) -> dict:
        """Stop sending; what it sent and the replies it read."""
        out, _ = self.proc.communicate("stop\n", timeout=120)
        assert self.proc.returncode == 0, out
        return json.loads(out.strip().splitlines()[-1])


def _expected(tiny_root, seed: int) -> list:
    out = []
    for _ in range(ROUNDS):
        solo = reference_engine(tiny_root)
        s = scenario(solo, seed)
        out.append([solo.propose(**s.call(p).kwargs).draft_token_ids for p in plans()])
    return out


def _good_client(server, tiny_root, expected: list) -> list[float]:
    """ROUNDS sessions through every plan; each step's drafts equal the solo run's.  Returns step seconds."""
    ref, latencies = reference_engine(tiny_root), []
    for r in range(ROUNDS):
        with ZmqDrafterClient(server.zmq_endpoint, timeout_s=60) as c:
            c.attach(layout_for(c.info(), SESSION_BLOCKS, client_name="good"))
            s = scenario(ref, 7)
            for i, plan in enumerate(plans()):
                t0 = time.perf_counter()
                got = c.propose(**s.call(plan).kwargs).draft_token_ids
                latencies.append(time.perf_counter() - t0)
                assert torch.equal(got, expected[r][i]), f"round {r} step {i}"
            c.detach()
    return latencies


def _p99(xs) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, 99))


def test_a_flooding_client_is_capped_and_another_keeps_its_drafts(server, tiny_root):
    expected = _expected(tiny_root, 7)
    unloaded = _good_client(server, tiny_root, expected)
    flooder = _Flooder(server, tiny_root)
    try:
        flooder.flooding()
        t0 = time.monotonic()
        loaded = _good_client(server, tiny_root, expected)
        seconds = time.monotonic() - t0
    finally:
        report = flooder.stop()
    print(f"\nflood: {report['sent']} messages in {seconds:.1f} s, replies read by code {report['codes']}")
    print(f"good client's p99 step: unloaded {_p99(unloaded):.1f} ms, under the flood {_p99(loaded):.1f} ms "
          f"({len(unloaded)} / {len(loaded)} steps)")
    codes = report["codes"]
    assert report["sent"] > CAP
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert codes.get("OK", 0) >= 1, "the flooder's calls within the cap are served"
    assert codes.get("RESOURCE_EXHAUSTED", 0) >= 1, "beyond the cap: refused at once"
    assert all(f"--max-inflight-per-client {CAP}" in m for m in report["messages"]), report["messages"]


@pytest.fixture(scope="module")
def held_server(tiny_root, tmp_path_factory, one_torch_thread):
    """With the test hooks: SIGUSR1 holds the engine thread before its next engine call, SIGUSR2 lets it go."""
    _, model = tiny_dirs(tiny_root, "eagle3")
    log = tmp_path_factory.mktemp("logs") / "held-server.log"
    with DrafterServer(model, "eagle3", log_path=log, kv_blocks=2 * SESSION_BLOCKS, block_sizes=16,
                       max_inflight_per_client=CAP, test_hooks="true", **SERVER_SETTINGS) as s:
        yield s


def _zmq_codes(sock, n: int) -> list[tuple[Code, str]]:
    out = []
    for _ in range(n):
        assert sock.poll(60_000, zmq.POLLIN), "every message gets a reply"
        env = msgspec.msgpack.decode(sock.recv_multipart()[1], type=schema.Envelope)
        out.append((Code(env.error.code), env.error.message) if env.error is not None else (Code.OK, ""))
    return out


def test_the_cap_counts_queued_and_running_calls_on_both_transports(held_server, tiny_root):
    """With the engine held, a client's first CAP calls stay in flight and every further one is refused at once;
    once the engine runs again the CAP held calls are served."""
    import grpc

    server, extra = held_server, 3
    with ZmqDrafterClient(server.zmq_endpoint, timeout_s=30) as c:
        c.attach(layout_for(c.info(), SESSION_BLOCKS, client_name="held"))
        kw = scenario(reference_engine(tiny_root), 3).call(next(plans())).kwargs
        sid, epoch = c.session.session_id, c.session.epoch
        header, frames = to_frames(sid, epoch, 1, kw)
        msg = [b"", _ENC.encode(schema.Envelope(call_id=1, method="Propose")), _ENC.encode(header),
               *[bytes(f) for f in frames]]

        server.signal(signal.SIGUSR1)
        server.wait_for("paused")
        for _ in range(CAP + extra):
            c.sock.send_multipart(msg)
        refused = _zmq_codes(c.sock, extra)  # while the engine is held only the refusals can come back
        assert [code for code, _ in refused] == [Code.RESOURCE_EXHAUSTED] * extra, refused
        assert all(f"--max-inflight-per-client {CAP}" in m for _, m in refused)
        server.signal(signal.SIGUSR2)
        server.wait_for("resumed")
        assert [code for code, _ in _zmq_codes(c.sock, CAP)] == [Code.OK] * CAP

        server.signal(signal.SIGUSR1)
        server.wait_for("paused")
        raw = bytes(to_raw(sid, epoch, 2, kw).data)
        with grpc.insecure_channel(server.grpc_target) as ch:
            propose = ch.unary_unary("/drafter.v1.Drafter/Propose", lambda b: b, lambda b: b)
            finished: queue.Queue = queue.Queue()
            futs = [propose.future(raw, timeout=120) for _ in range(CAP + extra)]
            for f in futs:
                f.add_done_callback(finished.put)
            done = [finished.get(timeout=60) for _ in range(extra)]  # only refusals complete while held
            assert [f.exception().code() for f in done] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * extra
            assert all(f"--max-inflight-per-client {CAP}" in f.exception().details() for f in done)
            server.signal(signal.SIGUSR2)
            server.wait_for("resumed")
            held = [f for f in futs if f not in done]
            assert [f.exception() for f in held] == [None] * CAP, "the held calls are served"
        c.detach()
