"""The bound step's header hop, target -> drafter, on this host: ZMQ data socket vs the doorbell.

    python bench/probe_header_hop.py [--steps 2000 --rounds 5 --out DIR]

A probe of the transports alone (no engine, no GPU): a child process plays the drafter's side of a
bound cuda_ipc binding as drafter.service.bound_sessions / bound_ipc serve it, threads and all (an
idle asyncio loop and an idle engine thread beside them): a data thread on a ZMQ ROUTER (tcp and
ipc, polled every POLL_MS as BoundSession._serve does) and a doorbell thread on
drafter.wire.doorbell (as IpcBoundSession._serve_doorbell does).  Each step the target sends a
StepHeader and waits for the StepDone, which carries the drafter's perf_counter_ns when the header
was in hand (one CLOCK_MONOTONIC on one host).  Per path: the header hop (target's send -> the
drafter has the frame), the reply hop and the round trip, p50 / p99 in us.  The paths take turns
in blocks of --steps, --rounds times, so a busy host weighs on each alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the checkout's packages
from coordinator.transport.bound_client import connect_socket  # noqa: E402
from drafter.service.bound_sessions import POLL_MS  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from drafter.wire import doorbell  # noqa: E402

PATHS = ("zmq_tcp", "zmq_ipc", "doorbell")
TOKEN = "probe-binding-id"


# ---------------------------------------------------------------------- the drafter's side (child)
def _answer(frame: bytes, received: int) -> bytes:
    head = wb.STEP_DECODER.decode(frame)
    return wb.encode(wb.StepDone(step=head.step, stamps=[received, received, received, time.perf_counter_ns()]))


def _serve_zmq(sock: zmq.Socket, stop: threading.Event) -> None:
    """BoundSession._serve's loop: poll, [identity, header], reply."""
    while not stop.is_set():
        if not sock.poll(POLL_MS):
            continue
        identity = sock.recv()
        frame = sock.recv()
        sock.send_multipart([identity, _answer(frame, time.perf_counter_ns())])


def _serve_bell(listener, stop: threading.Event) -> None:
    """IpcBoundSession._serve_doorbell's loop."""
    conn = doorbell.accept(listener, TOKEN, lambda: not stop.is_set(), POLL_MS / 1e3, 2.0)
    if conn is None:
        return
    conn.settimeout(POLL_MS / 1e3)
    while not stop.is_set():
        frame = doorbell.receive(conn, None)
        if frame is None:
            continue
        if not frame:
            return
        conn.send(_answer(frame, time.perf_counter_ns()))


def drafter_main(run_dir: str) -> int:
    """The child: the sockets, the threads, their addresses on stdout; ends when stdin closes."""
    stop = threading.Event()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="asyncio", daemon=True).start()  # as the service's loop
    engine = ThreadPoolExecutor(1, thread_name_prefix="engine")  # as the service's engine thread
    engine.submit(lambda: None).result()
    ctx = zmq.Context()
    socks = {}
    for name, endpoint in (("zmq_tcp", "tcp://127.0.0.1:*"), ("zmq_ipc", f"ipc://{run_dir}/bound.sock")):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        socks[name] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        threading.Thread(target=_serve_zmq, args=(sock, stop), name=f"data-{name}", daemon=True).start()
    listener, address = doorbell.listen()
    socks["doorbell"] = address
    threading.Thread(target=_serve_bell, args=(listener, stop), name="bell", daemon=True).start()
    print(json.dumps(socks), flush=True)
    sys.stdin.read()
    stop.set()
    return 0


# ---------------------------------------------------------------------- the target's side
class _Path:
    def __init__(self, name: str, address: str, ctx: zmq.Context):
        self.name = name
        if name == "doorbell":
            self.bell = doorbell.connect(address, TOKEN, 10)
        else:
            self.sock = connect_socket(ctx, address, data=True)
            if not self.sock.poll(10_000, zmq.POLLOUT):
                raise RuntimeError(f"{address} did not connect")
        self.hop: list[float] = []
        self.back: list[float] = []
        self.rtt: list[float] = []

    def step(self, step: int) -> None:
        frame = wb.encode(wb.StepHeader(step=step, num_tokens=64, batch=16, bind_id=TOKEN))
        sent = time.perf_counter_ns()
        if self.name == "doorbell":
            self.bell.send(frame)
            reply = doorbell.receive(self.bell, 10)
        else:
            self.sock.send(frame, flags=zmq.NOBLOCK)
            if not self.sock.poll(10_000):
                raise RuntimeError("no reply in 10 s")
            reply = self.sock.recv()
        answered = time.perf_counter_ns()
        done = wb.DONE_DECODER.decode(reply)
        self.hop.append((done.stamps[0] - sent) / 1e3)
        self.back.append((answered - done.stamps[3]) / 1e3)
        self.rtt.append((answered - sent) / 1e3)


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50_us": round(xs[len(xs) // 2], 1), "p99_us": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 1),
            "n": len(xs)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["drafter"]:
        return drafter_main(argv[1])
    p = argparse.ArgumentParser(prog="python bench/probe_header_hop.py", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="steps per path per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    import tempfile

    run_dir = tempfile.mkdtemp(prefix="hop-")
    child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "drafter", run_dir],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    try:
        addresses = json.loads(child.stdout.readline())
        paths = [_Path(name, addresses[name], ctx) for name in PATHS]
        step = 0
        for path in paths:  # warm-up, not kept
            for _ in range(args.warmup):
                step += 1
                path.step(step)
            path.hop, path.back, path.rtt = [], [], []
        for _ in range(args.rounds):
            for path in paths:
                for _ in range(args.steps):
                    step += 1
                    path.step(step)
        result = {path.name: {"header_hop": _stats(path.hop), "reply_hop": _stats(path.back),
                              "round_trip": _stats(path.rtt)} for path in paths}
    finally:
        child.stdin.close()
        child.wait(30)
        ctx.destroy(linger=0)
    lines = ["| path | header hop p50 / p99 us | reply hop p50 / p99 us | round trip p50 / p99 us |",
             "|---|---|---|---|"]
    for name, r in result.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[k]['p50_us']:.0f} / {r[k]['p99_us']:.0f}"
                                                for k in ("header_hop", "reply_hop", "round_trip")) + " |")
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "header_hop.json").write_text(json.dumps(result, indent=1))
        (out / "header_hop.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
