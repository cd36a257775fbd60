"""Probe on a GPU host: when a graph-replayed propose is slow on the host, what else is running?

    python bench/probe_host.py --out DIR [--k 5 --batch 16 --ctx 1024 --before 5 --after 40]

The 2026-11-24 record (bench/results/2026-11-24-h100-row-scale-norm) timed k=5's host time at 111-127 us
in one stretch of rows right after that engine's capture, and 29-39 us for the same calls a
minute later; a first run of this probe found a fixed pure-Python workload (bench.host_calibration)
twice as slow in that stretch as after it.  This samples, every --interval seconds, for --before
seconds before the EAGLE-3 8B engine is built and --after seconds after its graphs are captured:
  host_us         median host time of the trusted propose call (batch, k, ctx)
  python_us       host_calibration: the fixed pure-Python workload
  threads         this process's busiest threads over the interval (name: CPU seconds per second)
  machine_cpus_busy  the whole machine's busy CPUs over the interval (from /proc/stat)
and at the end (call_parts) each step of the call timed inside the same calls, as quantiles.
Writes DIR/probe_host.json and prints one line per sample.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from drafter.tools.bench.grid import (SPECS, as_inputs, build_engine, host_calibration, on_device, random_head,
                           steady_state_call, time_host)

TICK = 100  # clock ticks per second in /proc (USER_HZ)


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each thread of this process, keyed 'name/tid'."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[f"{name}/{task.name}"] = (int(fields[11]) + int(fields[12])) / TICK  # utime + stime
    return out


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def watch(seconds: float, interval: float, label: str, sample_call, log) -> list[dict]:
    samples = []
    end = time.perf_counter() + seconds
    threads, (busy, total), t_prev = thread_cpu(), machine_cpu(), time.perf_counter()
    while time.perf_counter() < end:
        time.sleep(interval)  # a probe, not a test: idle between samples on purpose
        row = {"phase": label, "t": time.time()}
        row.update(sample_call())
        now_threads, (now_busy, now_total), now = thread_cpu(), machine_cpu(), time.perf_counter()
        dt = now - t_prev
        use = {k: (v - threads.get(k, 0.0)) / dt for k, v in now_threads.items()}
        row["threads"] = dict(sorted(((k, round(v, 2)) for k, v in use.items() if v > 0.02),
                                     key=lambda kv: -kv[1])[:5])
        row["machine_cpus_busy"] = (now_busy - busy) / max(1, now_total - total) * os.cpu_count()
        threads, busy, total, t_prev = now_threads, now_busy, now_total, now
        samples.append(row)
        log(f"{label:7} host {row.get('host_us', float('nan')):6.1f} us | python {row['python_us']:5.1f} us | "
            f"machine CPUs busy {row['machine_cpus_busy']:4.1f} | threads {row['threads']}")
    return samples


def spin_wait(event) -> None:
    """Wait for the GPU in a Python loop over event.query(): the thread never sleeps."""
    event.record()
    while not event.query():
        pass


def call_parts(engine, call: dict, calls: int, wait=torch.cuda.synchronize) -> dict[str, dict[str, float]]:
    """Host microseconds of each step of the trusted graph-replayed propose, timed inside the same
    calls (GPU idle at each start), as quantiles over `calls`; beside them a one-kernel launch and
    a one-kernel graph's replay, the driver's smallest costs on this host."""
    from drafter.engine.graphs import on_device as inputs_on_device

    runner, device = engine.graphs, engine.device
    inp = as_inputs(call, device)
    b_pad, t_pad = engine._padded_sizes(inp, None, None)
    replay = runner.combined_graphs[(t_pad, b_pad)]
    tiny = torch.zeros(1, device=device)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        tiny.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        tiny.add_(1)
    slab = torch.empty(256, inp.batch_size, runner.width, dtype=torch.int64, device=device)
    views: list = []
    names = ("output_alloc", "header_wait", "free_previous", "header_write", "replay", "loaded", "part_sum", "whole_propose",
             "one_kernel_launch", "one_kernel_graph", "slab_view")
    times: dict[str, list[float]] = {n: [] for n in names}
    clock = time.perf_counter
    with torch.inference_mode():
        for i in range(calls):
            wait()
            t0 = clock()
            out = runner.new_output(inp.batch_size)
            t1 = clock()
            runner.header.wait_until_read()  # the previous call's DONE word: long set
            t1b = clock()
            runner.header.inputs = ()  # frees the previous call's output tensor
            t1c = clock()
            runner.header.write(inputs_on_device(inp, device), out)
            t2 = clock()
            replay()
            t3 = clock()
            runner.header.loaded()
            t4 = clock()
            views.append(slab[i % len(slab)])  # kept: a caller holds its drafts a while
            t4b = clock()
            wait()
            t5 = clock()
            engine.propose(**call, validate=False)
            t6 = clock()
            wait()
            t7 = clock()
            tiny.add_(1)
            t8 = clock()
            wait()
            t9 = clock()
            graph.replay()
            t10 = clock()
            for name, (a, b) in zip(names, ((t0, t1), (t1, t1b), (t1b, t1c), (t1c, t2), (t2, t3), (t3, t4), (t0, t4), (t5, t6),
                                            (t7, t8), (t9, t10), (t4, t4b))):
                times[name].append((b - a) * 1e6)
    torch.cuda.synchronize()

    def q(values, f):
        return values[min(len(values) - 1, int(f * len(values)))]
    return {n: {f"p{int(f * 100)}": q(sorted(v), f) for f in (0.1, 0.5, 0.9, 0.99)} for n, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--before", type=float, default=5)
    p.add_argument("--after", type=float, default=40)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--calls", type=int, default=3000, help="calls timed part by part at the end")
    p.add_argument("--skinny-gemm", default="on", choices=("auto", "on", "off"),
                   help="on (default): no start-up plan, so a cold machine compiles little; the graphs' launches are the same")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")

    def log(line):
        print(line, flush=True)

    spec = SPECS["eagle3-8b"]
    head = random_head(spec, device, torch.bfloat16)
    result = {"device": torch.cuda.get_device_name(), "samples": []}
    result["samples"] += watch(args.before, args.interval, "before", lambda: {"python_us": host_calibration()}, log)
    t0 = time.perf_counter()
    engine = build_engine(head, spec, args.k, [1, args.batch], args.ctx, device, args.skinny_gemm)
    with torch.inference_mode():
        engine.graphs.capture()
    log(f"engine built and captured in {time.perf_counter() - t0:.1f} s")
    call = on_device(steady_state_call(engine, args.batch, args.ctx, seed=1), device)

    def sample():
        with torch.inference_mode():
            python = host_calibration()
            host = statistics.median(time_host(lambda: engine.propose(**call, validate=False), 100))
        return {"python_us": python, "host_us": host}

    result["samples"] += watch(args.after, args.interval, "after", sample, log)
    event = torch.cuda.Event()
    waits = {"synchronize": torch.cuda.synchronize, "spin on event.query": lambda: spin_wait(event),
             "synchronize, pinned to one CPU": torch.cuda.synchronize}
    result["parts"] = {}
    for name, wait in waits.items():
        if "pinned" in name:
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
        result["parts"][name] = parts = call_parts(engine, call, args.calls, wait)
        log(f"waiting by {name}, affinity {sorted(os.sched_getaffinity(0))[:4]}...:")
        for part, q in parts.items():
            log(f"  {part:16} p10 {q['p10']:6.1f}  p50 {q['p50']:6.1f}  p90 {q['p90']:6.1f}  p99 {q['p99']:7.1f} us")
    (out / "probe_host.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
