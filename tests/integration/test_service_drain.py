"""SIGTERM during load: in-flight calls complete, later calls get UNAVAILABLE, exit 0.

The server runs with its test hooks: SIGUSR1 pauses the engine thread, so calls can be held in
flight for as long as the test needs (no timing involved), and SIGUSR2 resumes it.
"""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.transport import GrpcDrafterClient, ZmqDrafterClient
from drafter.wire.errors import Code, DrafterError
from tests.integration.conftest import K, SERVER_SETTINGS, SESSION_BLOCKS, reference_engine
from tests.integration.test_service_parity import scenario
from tests.support.engines import tiny_dirs
from tests.support.servers import DrafterServer, layout_for

PLAN = [(0, 6, 0), (1, 3, 0)]


def inflight(server) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("drafter_inflight_requests{"))


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    """Poll a condition the server exposes (not a sleep standing in for synchronisation)."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.02)


def health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


class Caller:
    """One session on one transport, calling propose from its own thread."""

    def __init__(self, server, info, kind: str, seed: int, tiny_root):
        self.kind = kind
        self.client = (ZmqDrafterClient(server.zmq_endpoint, timeout_s=120) if kind == "zmq"
                       else GrpcDrafterClient(server.grpc_target, timeout_s=120))
        self.client.attach(layout_for(info, SESSION_BLOCKS, client_name=f"{kind}-{seed}"))
        self.stream = self.client.stream() if kind == "stream" else None
        self.remote = scenario(reference_engine(tiny_root), seed)
        self.results: list = []

    def call(self):
        target = self.stream or self.client
        try:
            self.results.append(target.propose(**self.remote.call(PLAN).kwargs))
        except DrafterError as exc:
            self.results.append(exc)

    def close(self):
        if self.stream is not None:
            self.stream.close()
        self.client.close()


def test_sigterm_drains(tiny_root, tmp_path, one_torch_thread):
    _, model = tiny_dirs(tiny_root, "eagle3")
    server = DrafterServer(model, "eagle3", log_path=tmp_path / "server.log", kv_blocks=32 * SESSION_BLOCKS,
                           block_sizes=16, test_hooks="true", drain_timeout_s=120, **SERVER_SETTINGS)
    server.start()
    try:
        probe = GrpcDrafterClient(server.grpc_target, timeout_s=30)
        info = probe.info()
        held = [Caller(server, info, kind, seed, tiny_root)
                for seed, kind in enumerate(["grpc"] * 3 + ["stream"] * 2 + ["zmq"] * 3)]
        loaders = [Caller(server, info, kind, 100 + seed, tiny_root)
                   for seed, kind in enumerate(["grpc", "stream", "zmq", "zmq"])]
        idle = Caller(server, info, "stream", 50, tiny_root)
        idle.call()  # an open stream with no message in flight when SIGTERM comes
        late = Caller(server, info, "grpc", 51, tiny_root)
        late_zmq = Caller(server, info, "zmq", 52, tiny_root)

        stop_load = threading.Event()

        def load(c: Caller):
            while not stop_load.is_set():
                c.call()
                if isinstance(c.results[-1], Exception):
                    return
        load_threads = [threading.Thread(target=load, args=(c,)) for c in loaders]
        for t in load_threads:
            t.start()

        server.signal(signal.SIGUSR1)
        server.wait_for("paused")
        held_threads = [threading.Thread(target=c.call) for c in held]
        for t in held_threads:
            t.start()
        expected = len(held) + len(loaders)
        wait_until(lambda: inflight(server) == expected, f"{expected} calls in flight")

        server.signal(signal.SIGTERM)
        assert server.wait_for("draining")["inflight"] == expected
        stop_load.set()
        assert health(server.health_target) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert health(server.grpc_target) == health_pb2.HealthCheckResponse.NOT_SERVING
        for c in (late, late_zmq, idle):
            c.call()
            assert isinstance(c.results[-1], DrafterError), f"{c.kind}: a call after SIGTERM was served"
            assert c.results[-1].code == Code.UNAVAILABLE, c.results[-1]
        with pytest.raises(DrafterError) as e:
            probe.info()
        assert e.value.code == Code.UNAVAILABLE
        assert inflight(server) == expected, "refused calls are not in flight"

        server.signal(signal.SIGUSR2)  # let the held calls finish
        server.wait_for("resumed")
        for t in held_threads + load_threads:
            t.join(120)
        for c in held + loaders:
            bad = [r for r in c.results if isinstance(r, Exception)]
            assert not bad, f"{c.kind}: an in-flight call failed during the drain: {bad}"
            assert all(r.draft_token_ids.shape == (len(PLAN), K) for r in c.results)
        # and the held drafts are the right ones: session 0's first step, recomputed in process
        solo = reference_engine(tiny_root)
        assert torch.equal(held[0].results[0].draft_token_ids,
                           solo.propose(**scenario(solo, 0).call(PLAN).kwargs).draft_token_ids)

        stopped = server.wait_for("stopped", 120)
        assert stopped["clean"] is True
        assert server.proc.wait(60) == 0
    finally:
        if server.proc.poll() is None:
            server.signal(signal.SIGUSR2)  # never leave the engine paused behind a failed assertion
        server.stop()
        if server.proc.returncode not in (0, None):
            print(server.log_tail())
