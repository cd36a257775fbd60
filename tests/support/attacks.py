"""Every attack of issue 19 against one `drafter serve`, in a process of its own (the soak's attacker,
tests/integration/test_abuse_soak.py): each attack repeats in its own thread, its refusal checked, until a
line arrives on stdin (or it has run its most).  The process lowers its own CPU priority first (--nice),
so on a small box it models attackers on other machines: what the valid clients lose is the server's
cost of refusing, not the attackers' own CPU.  It prints {"event": "attacking"} once every attack has
started (the Propose flooder: once it floods), and at the end one JSON line: runs per attack, the first
errors (a refusal not as expected) and the CPU seconds it and its flooder spent between the two lines.

    python -m tests.support.attacks GRPC_TARGET ZMQ_ENDPOINT TINY_ROOT --max-message BYTES [--nice N]
        [--sched-idle] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import zmq

from drafter.wire import pbwire, schema

MiB = 1024 * 1024
FLOODS = 4  # bursts of the unread flood (each 1000 requests whose replies are never read)
BOUNDED = {"zmq-unread-flood": FLOODS, "zmq-propose-flood": 1}  # most runs of these attacks; the others: until stop
ATTACKS = ("grpc-million-fields", "grpc-large-refused", "zmq-frames", "zmq-bytes", "zmq-bad-utf8",
           "zmq-made-up-fields", "zmq-unread-flood", "zmq-propose-flood")
_ENC = msgspec.msgpack.Encoder()


def command(grpc_target: str, zmq_endpoint: str, tiny_root: Path, max_message: int, nice: int = 10,
            sched_idle: bool = False) -> tuple[list[str], dict]:
    """The argv and environment that run the attacker from a test (the repo on PYTHONPATH)."""
    from tests.support.servers import REPO

    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return ([sys.executable, "-m", "tests.support.attacks", grpc_target, zmq_endpoint, str(tiny_root),
             "--max-message", str(max_message), "--nice", str(nice), *(["--sched-idle"] if sched_idle else [])],
            {**os.environ, "PYTHONPATH": path})


def big_refused_request(size: int) -> bytes:
    """One unknown length-delimited top-level field of `size` bytes: a protobuf parser accepts it, the
    drafter refuses it (no session, no tensors)."""
    return pbwire._varint_bytes(99 << 3 | 2) + pbwire._varint_bytes(size) + b"\x01" * size


class Attacks:
    """Each attack in its own thread, repeated until stop; every refusal is checked."""

    def __init__(self, grpc_target: str, zmq_endpoint: str, tiny_root: Path, max_message: int,
                 only: tuple[str, ...] = ATTACKS):
        self.grpc_target, self.zmq_endpoint, self.tiny_root = grpc_target, zmq_endpoint, tiny_root
        self.max_message = max_message
        self.stop, self.counts, self.errors = threading.Event(), {}, []
        self.flooder_cpu_s = 0.0  # the Propose flooder's CPU seconds from its first flood to stop
        self.cpu_s = 0.0  # this process's CPU seconds from "attacking" to stop
        self.started = threading.Semaphore(0)
        self.threads = [threading.Thread(target=self._loop, args=(name, fn), daemon=True)
                        for name, fn in self.attacks().items() if name in only]

    def attacks(self) -> dict:
        """Each name of ATTACKS and the function that runs that attack once."""
        fns = (self._grpc_fields, self._grpc_large, self._zmq_frames, self._zmq_bytes, self._zmq_utf8,
               self._zmq_fields, self._zmq_flood, self._zmq_propose_flood)
        return dict(zip(ATTACKS, fns))

    def _loop(self, name, fn):
        ctx = zmq.Context()
        if name != "zmq-propose-flood":  # that one says so once its flooder floods
            self.started.release()
        try:
            while not self.stop.is_set() and self.counts.get(name, 0) < BOUNDED.get(name, float("inf")):
                fn(ctx)
                self.counts[name] = self.counts.get(name, 0) + 1
        except BaseException as exc:  # noqa: BLE001 - reported in the last line
            self.errors.append(f"{name}: {exc!r}"[:2000])
        finally:
            ctx.destroy(linger=0)

    def _grpc(self, raw: bytes) -> str:
        import grpc
        with grpc.insecure_channel(self.grpc_target, options=[("grpc.max_send_message_length", 64 * MiB)]) as ch:
            try:
                ch.unary_unary("/drafter.v1.Drafter/Propose", lambda b: b, lambda b: b)(raw, timeout=60)
            except grpc.RpcError as e:
                return e.code().name
        return "OK"

    def _grpc_fields(self, ctx):
        assert self._grpc((b"\xa0\x06\x00") * 1_000_000) == "INVALID_ARGUMENT"

    def _grpc_large(self, ctx):
        assert self._grpc(big_refused_request(self.max_message - 1024)) == "INVALID_ARGUMENT"

    def _zmq(self, ctx, parts: list) -> schema.Envelope:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.zmq_endpoint)
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
        env = self._zmq(ctx, [_ENC.encode(schema.Envelope(method="Info")), _ENC.encode({f"made_up_{n}": 1})])
        assert env.error is not None

    def _zmq_flood(self, ctx):
        """Many requests without reading the replies, then the socket is dropped."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.zmq_endpoint)
        info = [_ENC.encode(schema.Envelope(method="Info")), b""]
        for _ in range(1000):
            sock.send_multipart(info)
        sock.close(linger=0)

    def _zmq_propose_flood(self, ctx):
        """Valid Propose messages on its own session, replies unread, until stop (at most 4000; past
        --max-inflight-per-client they are refused at once), then Detach: tests/support/flood.py, a process
        of its own (its busy loop shares no interpreter lock with the other attacks); it inherits the nice."""
        from tests.support import flood
        from tests.support.servers import REPO

        argv, env = flood.command(self.zmq_endpoint, self.tiny_root, "--most", "4000", "--ready-after", "1",
                                  "--stop-on-stdin", "--then", "detach")
        with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=REPO, env=env) as proc:
            try:
                ready = proc.stdout.readline()  # {"event": "flooding"}: its imports and attach are done
                cpu0 = process_cpu_s(proc.pid)
            finally:
                self.started.release()
            assert "flooding" in ready, proc.stderr.read()[-2000:]
            self.stop.wait()
            self.flooder_cpu_s = process_cpu_s(proc.pid) - cpu0
            _, err = proc.communicate("stop\n", timeout=300)
        assert proc.returncode == 0, err[-2000:]

    def run_until_stdin(self) -> None:
        for t in self.threads:
            t.start()
        for _ in self.threads:
            self.started.acquire()
        print(json.dumps({"event": "attacking"}), flush=True)
        cpu0 = process_cpu_s(os.getpid())
        sys.stdin.readline()
        self.cpu_s = process_cpu_s(os.getpid()) - cpu0
        self.stop.set()
        for t in self.threads:
            t.join(120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("grpc_target")
    p.add_argument("zmq_endpoint")
    p.add_argument("tiny_root", type=Path)
    p.add_argument("--max-message", type=int, required=True)
    p.add_argument("--nice", type=int, default=10)
    p.add_argument("--sched-idle", action="store_true",
                   help="SCHED_IDLE: run only on CPU time nothing else of this box wants")
    p.add_argument("--only", action="append", choices=ATTACKS, help="run only this attack (repeatable)")
    args = p.parse_args(argv)
    lower_priority(args.nice, args.sched_idle)
    attacks = Attacks(args.grpc_target, args.zmq_endpoint, args.tiny_root, args.max_message,
                      tuple(args.only or ATTACKS))
    attacks.run_until_stdin()
    print(json.dumps({"event": "done", "counts": attacks.counts, "errors": attacks.errors[:3],
                      "cpu_s": attacks.cpu_s + attacks.flooder_cpu_s}), flush=True)
    return 0


def lower_priority(nice: int, sched_idle: bool) -> None:
    """Before any thread starts (Linux applies both per thread; threads started later inherit them, and so
    does the Propose flooder's process)."""
    os.nice(nice)
    if sched_idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def process_cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (user + system, all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    sys.exit(main())
