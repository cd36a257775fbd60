"""Probe on a GPU host: what the host calls of a propose cost, hot in a loop and right after the
host waited for the GPU (as a caller that reads its results each step does).

    python bench/probe_host_calls.py [--json OUT]

Part 1 times single torch / CUDA calls back to back (best and median of repeats).  Part 2 times
a stand-in for the propose call's host work (an output allocation, ~30 tensor attribute reads,
a pinned header write, an event record, a small graph's replay) after the GPU ran ~1.5 ms of
work, waited for in different ways: torch.cuda.synchronize(), a Python loop over event.query(),
a synchronize followed by ~100 us of Python, and no wait at all (the GPU still busy).  If the
stand-in is slow only right after a wait, the host time is the wake-up, not the call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import time

import torch
import triton
import triton.language as tl


def per_call(fn, calls=2000, repeats=5):
    for _ in range(100):
        fn()
    res = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        res.append((time.perf_counter() - t0) / calls * 1e6)
    return min(res), statistics.median(res)


@triton.jit
def _read_words(src_ptr, dst_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs))


def pinned_write_after_gpu_read(pack) -> dict:
    """Host microseconds of one 48-word write into pinned memory that a kernel read (in place,
    over PCIe) since the last write, against one no kernel ever reads; the GPU idle both times."""
    d = torch.device("cuda")
    read = torch.zeros(512, dtype=torch.int64, pin_memory=True)
    unread = torch.zeros(512, dtype=torch.int64, pin_memory=True)
    sink = torch.zeros(64, dtype=torch.int64, device=d)
    out = {}
    for name, buf, gpu_reads in (("read by a kernel", read, True), ("never read", unread, False),
                                 ("read, 2nd write", read, True)):
        words = buf.numpy()
        times = []
        for _ in range(600):
            if gpu_reads:
                _read_words[(1,)](read, sink, N=64)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pack(words, 0, *range(48))
            if name.endswith("2nd write"):
                t0 = time.perf_counter()
                pack(words, 0, *range(48))
            times.append((time.perf_counter() - t0) * 1e6)
        times.sort()
        out[name] = q = {f"p{int(f * 100)}": times[int(f * len(times))] for f in (0.1, 0.5, 0.9)}
        print(f"pinned write, {name:18} p10 {q['p10']:6.1f}  p50 {q['p50']:6.1f}  p90 {q['p90']:6.1f} us", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    d = torch.device("cuda")
    t = torch.zeros(64, dtype=torch.int32, device=d)
    ev = torch.cuda.Event()
    ev.record()
    torch.cuda.synchronize()
    host = torch.zeros(64, dtype=torch.int64, pin_memory=True)
    words = host.numpy()
    pack = struct.Struct("=48q").pack_into
    s = torch.cuda.current_stream()
    result = {"device": torch.cuda.get_device_name(), "single_calls_us": {}, "after_wait_us": {}}
    tests = {
        "t.data_ptr()": t.data_ptr, "t.dtype": lambda: t.dtype, "t.is_contiguous()": t.is_contiguous,
        "t.stride()": t.stride, "torch.empty cuda": lambda: torch.empty((16, 5), dtype=torch.int64, device=d),
        "event.synchronize (done)": ev.synchronize, "event.query (done)": ev.query,
        "event.record": lambda: ev.record(s), "pinned pack 48 words": lambda: pack(words, 0, *range(48)),
    }
    for name, fn in tests.items():
        torch.cuda.synchronize()
        mn, med = per_call(fn)
        result["single_calls_us"][name] = {"min": mn, "median": med}
        print(f"{name:28} min {mn:7.3f} us  median {med:7.3f} us", flush=True)

    tiny = torch.zeros(1, device=d)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        tiny.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(40):  # a graph of a propose's size in nodes
            tiny.add_(1)
    tensors = [torch.zeros(16, dtype=torch.int32, device=d) for _ in range(10)]
    done = torch.cuda.Event()

    def stand_in():
        out = torch.empty((16, 5), dtype=torch.int64, device=d)
        vals = [out.data_ptr()]
        for x in tensors:
            if x.dtype is torch.int32 and x.is_contiguous():
                vals += (x.data_ptr(), x.stride()[0])
        vals += [0] * (48 - len(vals))
        pack(words, 0, *vals)
        graph.replay()
        ev.record(s)

    def spin_query():
        done.record(s)
        while not done.query():
            pass

    def sync_then_python():
        torch.cuda.synchronize()
        x = 0
        for i in range(3000):
            x += i & 7

    waits = {"synchronize": torch.cuda.synchronize, "spin on event.query": spin_query,
             "synchronize + 100 us python": sync_then_python, "no wait (GPU busy)": lambda: None}
    for name, wait in waits.items():
        times = []
        for i in range(600):
            torch.cuda._sleep(1_500_000)  # ~1 ms of GPU work before each call
            wait()
            t0 = time.perf_counter()
            stand_in()
            times.append((time.perf_counter() - t0) * 1e6)
            if name.startswith("no wait") and i % 20 == 19:
                torch.cuda.synchronize()  # keep the queue short
        torch.cuda.synchronize()
        times.sort()
        q = {f"p{int(f * 100)}": times[int(f * len(times))] for f in (0.1, 0.5, 0.9)}
        result["after_wait_us"][name] = q
        print(f"stand-in after {name:28} p10 {q['p10']:6.1f}  p50 {q['p50']:6.1f}  p90 {q['p90']:6.1f} us", flush=True)
    result["pinned_write_us"] = pinned_write_after_gpu_read(pack)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
