"""A bounded soak (issue 19): valid clients on both transports run their scenarios while attackers send
every kind of abuse the issue lists, at once, against one `drafter serve` on loopback.

Asserted: each valid client's drafts equal its solo engine's, every attack gets its refusal, the
server's RSS stays within a generous bound, and the refusal log stays throttled.  Printed, not asserted
(no timing asserts): the valid clients' p99 step latency unloaded and under attack.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import msgspec
import numpy as np
import pytest
import torch
import zmq

from coordinator.transport import GrpcDrafterClient, ZmqDrafterClient
from drafter.wire import pbwire, schema
from tests.integration.conftest import SERVER_SETTINGS, SESSION_BLOCKS, reference_engine
from tests.integration.test_abuse_grpc_memory import _big_refused_request, rss_mib
from tests.integration.test_service_parity import plans, scenario
from tests.support import flood
from tests.support.engines import tiny_dirs
from tests.support.servers import REPO, DrafterServer, layout_for

MiB = 1024 * 1024
MAX_MESSAGE = 16 * MiB
ROUNDS = 2  # passes over plans() per valid client and phase
FLOODS = 4  # bursts of the unread flood (each 1000 requests whose replies are never read)
BOUNDED = {"zmq-unread-flood": FLOODS, "zmq-propose-flood": 1}  # most runs of these attacks; the others: until the end
_ENC = msgspec.msgpack.Encoder()


@pytest.fixture(scope="module")
def server(tiny_root, tmp_path_factory, one_torch_thread):
    _, model = tiny_dirs(tiny_root, "eagle3")
    log = tmp_path_factory.mktemp("logs") / "soak-server.log"
    with DrafterServer(model, "eagle3", log_path=log, kv_blocks=8 * SESSION_BLOCKS, block_sizes=16,
                       batch_window_us=500, max_message_bytes=MAX_MESSAGE, **SERVER_SETTINGS) as s:
        yield s


def _expected(tiny_root, seed: int) -> list:
    solo = reference_engine(tiny_root)
    out = []
    for _ in range(ROUNDS):
        s = scenario(solo, seed)
        out.append([solo.propose(**s.call(p).kwargs).draft_token_ids for p in plans()])
        solo = reference_engine(tiny_root)
    return out


def _valid_client(make, server, tiny_root, seed: int, expected: list, latencies: list) -> None:
    """ROUNDS sessions one after the other, each through every plan, drafts compared with the solo run."""
    ref = reference_engine(tiny_root)
    for r in range(ROUNDS):
        c = make()
        try:
            c.attach(layout_for(c.info(), SESSION_BLOCKS, client_name=f"valid-{seed}"))
            s = scenario(ref, seed)
            for i, plan in enumerate(plans()):
                t0 = time.perf_counter()
                got = c.propose(**s.call(plan).kwargs).draft_token_ids
                latencies.append(time.perf_counter() - t0)
                assert torch.equal(got, expected[r][i]), f"client {seed} round {r} step {i}"
            c.detach()
        finally:
            c.close()


def _run_valid(server, tiny_root, expected) -> list:
    latencies: list = []
    makers = [lambda: GrpcDrafterClient(server.grpc_target, timeout_s=60),
              lambda: ZmqDrafterClient(server.zmq_endpoint, timeout_s=60),
              lambda: ZmqDrafterClient(server.zmq_endpoint, timeout_s=60)]
    errors: list = []

    def run(i, make):
        try:
            _valid_client(make, server, tiny_root, 11 + i, expected[i], latencies)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i, m)) for i, m in enumerate(makers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return latencies


class _Attacks:
    """Each attack in its own thread, repeated until stop; every refusal is checked."""

    def __init__(self, server, tiny_root):
        self.server, self.stop, self.counts, self.errors = server, threading.Event(), {}, []
        self.tiny_root = tiny_root
        self.threads = [threading.Thread(target=self._loop, args=(name, fn), daemon=True)
                        for name, fn in self._attacks().items()]

    def _attacks(self) -> dict:
        return {"grpc-million-fields": self._grpc_fields, "grpc-large-refused": self._grpc_large,
                "zmq-frames": self._zmq_frames, "zmq-bytes": self._zmq_bytes, "zmq-bad-utf8": self._zmq_utf8,
                "zmq-made-up-fields": self._zmq_fields, "zmq-unread-flood": self._zmq_flood,
                "zmq-propose-flood": self._zmq_propose_flood}

    def _loop(self, name, fn):
        ctx = zmq.Context()
        try:
            while not self.stop.is_set() and self.counts.get(name, 0) < BOUNDED.get(name, float("inf")):
                fn(ctx)
                self.counts[name] = self.counts.get(name, 0) + 1
        except BaseException as exc:  # noqa: BLE001
            self.errors.append((name, exc))
        finally:
            ctx.destroy(linger=0)

    def _grpc(self, raw: bytes) -> str:
        import grpc
        with grpc.insecure_channel(self.server.grpc_target,
                                   options=[("grpc.max_send_message_length", 64 * MiB)]) as ch:
            try:
                ch.unary_unary("/drafter.v1.Drafter/Propose", lambda b: b, lambda b: b)(raw, timeout=60)
            except grpc.RpcError as e:
                return e.code().name
        return "OK"

    def _grpc_fields(self, ctx):
        assert self._grpc((b"\xa0\x06\x00") * 1_000_000) == "INVALID_ARGUMENT"

    def _grpc_large(self, ctx):
        assert self._grpc(_big_refused_request(MAX_MESSAGE - 1024)) == "INVALID_ARGUMENT"

    def _zmq(self, ctx, parts: list) -> schema.Envelope:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.server.zmq_endpoint)
        try:
            sock.send_multipart(parts)
            assert sock.poll(60_000), "every message gets a reply"
            return msgspec.msgpack.decode(sock.recv_multipart()[0], type=schema.Envelope)
        finally:
            sock.close(linger=0)

    def _refused(self, env, field: str) -> None:
        assert env.error is not None and env.error.field == field, env.error

    def _zmq_frames(self, ctx):
        self._refused(self._zmq(ctx, [_ENC.encode(schema.Envelope(method="Propose")), b""] + [b"z"] * 5000),
                      "frames")

    def _zmq_bytes(self, ctx):
        chunk = b"\0" * (4 * MiB)
        self._refused(self._zmq(ctx, [_ENC.encode(schema.Envelope(method="Propose")), b""] + [chunk] * 5),
                      "frames")

    def _zmq_utf8(self, ctx):
        body = _ENC.encode(schema.AttachRequest(client_name="QQQQ")).replace(b"QQQQ", b"\xff\xfe\xfd\xfc")
        self._refused(self._zmq(ctx, [_ENC.encode(schema.Envelope(method="Attach")), body]), "client_name")

    def _zmq_fields(self, ctx):
        n = self.counts.get("zmq-made-up-fields", 0)
        body = _ENC.encode({f"made_up_{n}": 1})
        env = self._zmq(ctx, [_ENC.encode(schema.Envelope(method="Info")), body])
        assert env.error is not None

    def _zmq_flood(self, ctx):
        """Many requests without reading the replies, then the socket is dropped."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.server.zmq_endpoint)
        info = [_ENC.encode(schema.Envelope(method="Info")), b""]
        for _ in range(1000):
            sock.send_multipart(info)
        sock.close(linger=0)

    def _zmq_propose_flood(self, ctx):
        """Valid Propose messages on its own session, replies unread, until the soak ends (at most 4000; past
        --max-inflight-per-client they are refused at once), then Detach.  In its own process
        (tests/support/flood.py), so its busy loop holds no lock of this process's valid clients."""
        argv, env = flood.command(self.server.zmq_endpoint, self.tiny_root, "--most", "4000", "--ready-after", "1",
                                  "--stop-on-stdin", "--then", "detach")
        with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=REPO, env=env) as proc:
            self.stop.wait()
            _, err = proc.communicate("stop\n", timeout=300)
        assert proc.returncode == 0, err[-2000:]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(120)


def _p99(xs) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, 99))


def test_soak_valid_clients_under_every_attack(server, tiny_root):
    expected = [_expected(tiny_root, 11 + i) for i in range(3)]
    pid = server.proc.pid
    unloaded = _run_valid(server, tiny_root, expected)
    rss_before = rss_mib(pid)
    t0 = time.monotonic()
    with _Attacks(server, tiny_root) as attacks:
        loaded = _run_valid(server, tiny_root, expected)
    seconds = time.monotonic() - t0
    rss_after = rss_mib(pid)
    refused_lines = sum(1 for ln in server.log_path.read_text().splitlines()
                        if '"event": "refused"' in ln)
    print(f"\nsoak {seconds:.1f} s; attacks sent: {dict(sorted(attacks.counts.items()))}")
    print(f"valid clients' p99 step: unloaded {_p99(unloaded):.1f} ms, under attack {_p99(loaded):.1f} ms "
          f"({len(unloaded)} / {len(loaded)} steps)")
    print(f"server RSS {rss_before:.0f} -> {rss_after:.0f} MiB; 'call refused' log lines: {refused_lines}")
    assert not attacks.errors, attacks.errors[:3]
    assert all(attacks.counts.get(name) for name in attacks._attacks()), attacks.counts
    assert rss_after - rss_before < 400, "the attacks must not grow the server's memory"
    assert refused_lines <= 2 * 3 * 16, "the refusal log is throttled per (transport, rpc, code)"
