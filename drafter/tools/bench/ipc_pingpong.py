"""The floor of any two-process design on one GPU: an event ping-pong between a "target" and a "drafter".

    python -m drafter.tools.bench.ipc_pingpong [--out DIR --work-us 0,900 --iters 300 --transport tcp]

Two processes on one GPU (this one, the target, and a spawned one, the drafter), each with its own
CUDA context, as the cuda_ipc plane of bound sessions runs (drafter.service.bound_ipc and
coordinator.transport.bound_ipc).  Per step the target records its interprocess "inputs" event,
sends a header over ZMQ (DEALER -> ROUTER, tcp on 127.0.0.1 or ipc), the drafter queues W us of GPU
work behind that event, records its "done" event and answers; the target reads 8 int64 written
by the drafter (shared once over CUDA IPC) to its host.  The drafter's work is a CUDA graph of
bf16 GEMVs over a 128 MiB matrix (memory bound, every SM busy, like a draft head's decode step)
repeated to about W us, or nothing (W = 0: the handover alone).

Modes (the same work and the same message every time):
  * local: one process, the work then the read: the in-process baseline;
  * stream_wait: as the plane is built: the drafter replies as soon as the work is queued; the
    target's stream waits on the drafter's event, then the read (the target's context holds a
    pending wait while the drafter's kernels run);
  * host_sync: the drafter replies as soon as the work is queued; the target's host waits on the
    drafter's event (cudaEventSynchronize), then queues the read (no pending work in its context
    while the drafter's kernels run);
  * reply_done: the drafter's host waits for its own work before replying; the target then reads
    (nothing of the target's is queued before the drafter's work ends; one more host wake-up);
  * stream_wait_hop: stream_wait, the drafter's socket thread handing the step to a worker thread
    and waiting for it (concurrent.futures), as the unbound service and the first cuda_ipc build do;
  * host_only: no GPU at all, the ZMQ round trip and wake-ups alone;
  * stream_wait_spin, host_only_spin: as stream_wait and host_only, both sides spinning on a
    non-blocking receive instead of sleeping in poll (what the sockets' wake-ups cost; ZMQ's own
    I/O threads still hand each message over).
Each step is stamped with perf_counter_ns on both sides (CLOCK_MONOTONIC: one clock on one
host): the medians of each stage are reported beside the p50 / p99 of the whole step.
pingpong.json and pingpong.md in --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

MODES = ("local", "stream_wait", "host_sync", "reply_done", "stream_wait_hop", "host_only", "stream_wait_spin",
         "host_only_spin")
ROWS, COLS = 4096, 16384  # the GEMV's matrix: 128 MiB of bf16
WARMUP = 30
STAGES = (("to drafter", "sent", "received"), ("drafter: read to queued", "received", "queued"),
          ("drafter: queued to reply", "queued", "replied"), ("reply to target", "replied", "answered"),
          ("target: reply to host read", "answered", "read"), ("queued to host read", "queued", "read"),
          ("whole step", "sent", "read"))


class Work:
    """About `us` microseconds of GPU work as one CUDA graph (GEMVs over one matrix), or none."""

    def __init__(self, us: float, device: torch.device):
        self.graph = None
        if us <= 0:
            return
        self.w = torch.randn(ROWS, COLS, dtype=torch.bfloat16, device=device)  # [rows, cols]
        self.x = torch.randn(1, ROWS, dtype=torch.bfloat16, device=device)  # [1, rows]
        self.y = torch.empty(1, COLS, dtype=torch.bfloat16, device=device)  # [1, cols]
        one = self._time_one(device)
        self.repeats = max(1, round(us / one))
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._body()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body()
        self.gpu_us = self._time_graph()

    def _body(self):
        for _ in range(getattr(self, "repeats", 1)):
            torch.matmul(self.x, self.w, out=self.y)

    def _time_one(self, device) -> float:
        for _ in range(5):
            self._body()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            torch.matmul(self.x, self.w, out=self.y)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / 50

    def _time_graph(self) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.graph.replay()
        start.record()
        for _ in range(20):
            self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / 20

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()


# ---------------------------------------------------------------------- the drafter's process
def drafter_main(endpoint: str, setup_q, device_index: int) -> None:
    """Bind a ROUTER, share an output and a "done" event, then answer steps until told to stop."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if device_index < 0:  # no GPU: host_only alone (a check of this script on CPU)
        setup_q.put((bound, None, b""))
    else:
        device = torch.device("cuda", device_index)
        torch.cuda.set_device(device)
        out = torch.zeros(8, dtype=torch.int64, device=device)  # [8]: what the target reads back
        done = torch.cuda.Event(interprocess=True)
        done.record()
        stream = torch.cuda.current_stream(device)
        setup_q.put((bound, out, bytes(done.ipc_handle())))
    inputs = None
    work = Work(0, None)
    hop = concurrent.futures.ThreadPoolExecutor(1)
    spin = False  # the last step's mode ended in _spin: spin for the next one
    while True:
        identity, body = _receive(sock, spin)
        received = time.perf_counter_ns()
        msg = json.loads(body)
        if "stop" in msg:
            sock.send_multipart([identity, b"{}"])
            break
        if "setup" in msg:  # a new work size, and the target's event
            if device_index >= 0:
                inputs = torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(msg["inputs"]))
                work = Work(msg["work_us"], device)
            sock.send_multipart([identity, json.dumps({"gpu_us": getattr(work, "gpu_us", 0.0)}).encode()])
            continue
        mode, step = msg["mode"], msg["step"]
        spin = mode.endswith("_spin")
        mode = mode.removesuffix("_spin")

        def queue_step():
            stream.wait_event(inputs)
            work.run()
            out.fill_(step)
            done.record(stream)
            return time.perf_counter_ns()

        if mode == "host_only":
            queued = time.perf_counter_ns()
        elif mode == "stream_wait_hop":
            queued = hop.submit(queue_step).result()
        else:
            queued = queue_step()
        if mode == "reply_done":
            done.synchronize()
        stamps = {"received": received, "queued": queued, "replied": time.perf_counter_ns()}
        sock.send_multipart([identity, json.dumps(stamps).encode()])
    hop.shutdown()
    sock.close(linger=0)
    ctx.term()


def _receive(sock, spin: bool) -> list:
    """The next message: sleeping in the socket's receive, or spinning on a non-blocking one."""
    import zmq

    if not spin:
        return sock.recv_multipart()
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            continue


# ---------------------------------------------------------------------- the target's process
class Target:
    def __init__(self, args):
        import zmq

        self.zmq = zmq
        self.args = args
        self.gpu = args.device_index >= 0
        self.device = torch.device("cuda", args.device_index) if self.gpu else None
        if self.gpu:
            torch.cuda.set_device(self.device)
        ctx = mp.get_context("spawn")
        setup_q = ctx.Queue()
        endpoint = "tcp://127.0.0.1:*" if args.transport == "tcp" else f"ipc:///tmp/drafter-pingpong-{time.time_ns()}"
        self.proc = ctx.Process(target=drafter_main, args=(endpoint, setup_q, args.device_index), daemon=True)
        self.proc.start()
        bound, self.shared_out, done_handle = setup_q.get(timeout=120)
        if self.gpu:
            self.done = torch.cuda.Event.from_ipc_handle(self.device, done_handle)
            self.inputs = torch.cuda.Event(interprocess=True)
            self.inputs.record()
            self.host = torch.zeros(8, dtype=torch.int64, pin_memory=True)  # [8]
            self.stream = torch.cuda.current_stream(self.device)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(bound)
        self.step_no = 0

    def _ask(self, msg: dict, spin: bool = False) -> dict:
        self.sock.send(json.dumps(msg).encode())
        return json.loads(_receive(self.sock, spin)[0])

    def setup(self, work_us: float) -> float:
        """The drafter's work of about work_us; its measured GPU time."""
        handle = bytes(self.inputs.ipc_handle()).hex() if self.gpu else ""
        return self._ask({"setup": 1, "work_us": work_us, "inputs": handle})["gpu_us"]

    def step(self, name: str) -> dict:
        self.step_no += 1
        mode = name.removesuffix("_spin")
        if mode != "host_only":
            self.inputs.record(self.stream)
        sent = time.perf_counter_ns()
        stamps = self._ask({"mode": name, "step": self.step_no}, spin=name.endswith("_spin"))
        stamps.update(sent=sent, answered=time.perf_counter_ns())
        if mode in ("stream_wait", "stream_wait_hop"):
            self.stream.wait_event(self.done)
        elif mode == "host_sync":
            self.done.synchronize()
        if mode != "host_only":
            self.host.copy_(self.shared_out, non_blocking=True)
            self.stream.synchronize()
            if int(self.host[0]) != self.step_no:
                raise RuntimeError(f"{mode}: read {int(self.host[0])} for step {self.step_no}: not ordered")
        stamps["read"] = time.perf_counter_ns()
        return stamps

    def close(self) -> None:
        self._ask({"stop": 1})
        self.proc.join(timeout=30)
        self.sock.close(linger=0)
        self.ctx.term()


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50_us": xs[len(xs) // 2], "p99_us": xs[min(len(xs) - 1, int(0.99 * len(xs)))], "n": len(xs)}


def local(work_us: float, device: torch.device, iters: int) -> tuple[dict, float]:
    """The same work and read in this process alone: p50 / p99 of the step, the work's GPU time."""
    work = Work(work_us, device)
    out = torch.zeros(8, dtype=torch.int64, device=device)  # [8]
    host = torch.zeros(8, dtype=torch.int64, pin_memory=True)  # [8]
    stream = torch.cuda.current_stream(device)
    times = []
    for i in range(WARMUP + iters):
        t0 = time.perf_counter_ns()
        work.run()
        out.fill_(i)
        host.copy_(out, non_blocking=True)
        stream.synchronize()
        if i >= WARMUP:
            times.append((time.perf_counter_ns() - t0) / 1e3)
    return _stats(times), getattr(work, "gpu_us", 0.0)


def measure(target: Target, mode: str, iters: int) -> dict:
    rows: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    for i in range(WARMUP + iters):
        st = target.step(mode)
        if i >= WARMUP:
            for name, a, z in STAGES:
                rows[name].append((st[z] - st[a]) / 1e3)
    return {name: _stats(xs) for name, xs in rows.items()}


def table(result: dict) -> str:
    lines = [f"# Two-process event ping-pong on one GPU ({result['meta']['device']}, {result['meta']['date']})", "",
             f"ZMQ {result['meta']['transport']}; p50 / p99 of the whole step in us; over local = p50 / the "
             "one-process p50 of the same work", "",
             "| work | GPU us | mode | p50 | p99 | over local | to drafter | drafter read to queued | "
             "reply to target | queued to host read |", "|---|---|---|---|---|---|---|---|---|---|"]
    for work, row in result["work"].items():
        base = row["local"]["p50_us"]
        lines.append(f"| {work} | {row['gpu_us']:.0f} | local | {base:.0f} | {row['local']['p99_us']:.0f} | | | | | |")
        for mode, st in row["modes"].items():
            whole = st["whole step"]
            lines.append(f"| {work} | | {mode} | {whole['p50_us']:.0f} | {whole['p99_us']:.0f} | "
                         f"{whole['p50_us'] - base:+.0f} | {st['to drafter']['p50_us']:.0f} | "
                         f"{st['drafter: read to queued']['p50_us']:.0f} | {st['reply to target']['p50_us']:.0f} | "
                         f"{st['queued to host read']['p50_us']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m drafter.tools.bench.ipc_pingpong", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/latest")
    p.add_argument("--work-us", default="0,900", help="the drafter's GPU work per step, comma-separated")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--transport", choices=("tcp", "ipc"), default="tcp")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--device-index", type=int, default=0)
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not torch.cuda.is_available():  # a check of the script: the ZMQ round trip alone
        print("no GPU: host_only alone", flush=True)
        args.device_index, modes = -1, [m for m in modes if m.startswith("host_only")]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; choose from {MODES}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", args.device_index) if args.device_index >= 0 else None
    result = {"meta": {"device": torch.cuda.get_device_name(device) if device else "cpu", "transport": args.transport,
                       "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "command": "python -m drafter.tools.bench.ipc_pingpong " + " ".join(argv)}, "work": {}}
    target = Target(args)
    try:
        for work_us in [float(w) for w in args.work_us.split(",")]:
            base, gpu_us = local(work_us, device, args.iters) if device else ({"p50_us": 0.0, "p99_us": 0.0}, 0.0)
            row = result["work"][f"{work_us:.0f}us"] = {"local": base, "gpu_us": gpu_us, "modes": {}}
            remote_gpu = target.setup(work_us)
            print(f"work {work_us:.0f} us: GPU {gpu_us:.0f} us here, {remote_gpu:.0f} us in the drafter; "
                  f"local p50 {base['p50_us']:.0f} us", flush=True)
            for mode in modes:
                if mode == "local":
                    continue
                st = row["modes"][mode] = measure(target, mode, args.iters)
                print(f"  {mode}: p50 {st['whole step']['p50_us']:.0f} us p99 {st['whole step']['p99_us']:.0f} us; "
                      + ", ".join(f"{n} {s['p50_us']:.0f}" for n, s in st.items() if n != "whole step"), flush=True)
            (out / "pingpong.json").write_text(json.dumps(result, indent=1))
            (out / "pingpong.md").write_text(table(result))
    finally:
        target.close()
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
