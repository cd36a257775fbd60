"""Host cost of single torch / numpy / CUDA operations on a GPU host, timed right after the host
waited for the GPU (as inside a propose call: "cold") and in a tight loop ("hot"), median us.
The service's per-call path is made of these.

    python bench/probe_host_ops.py            # in a bare process
    python bench/probe_host_ops.py --engine   # the same, then inside a process holding an EAGLE-3 8B
                                              # engine, with the garbage collector as it is, frozen, off

With --engine it also times the trusted propose call under each collector setting: whether the
engine process's larger heap, not the host, is what makes its calls slow.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np
import torch


def cold(fn, wait, n: int = 300) -> float:
    out = []
    for _ in range(n):
        wait()  # as a caller: right after waiting for the GPU
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def hot(fn, n: int = 2000) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def op_cases(device) -> dict:
    buf = torch.empty(1 << 22, dtype=torch.uint8, pin_memory=True)
    buf_np = buf.numpy()
    pinned = torch.from_numpy(buf_np[:512].view(np.int64))
    pageable = torch.zeros(64, dtype=torch.int64)
    g = torch.zeros(64, dtype=torch.int64, device=device)
    x = torch.zeros(64, 12288, dtype=torch.bfloat16, device=device)
    slab = torch.zeros(64, 16, 3, dtype=torch.int64, device=device)
    return {
        "is_pinned(pinned)": lambda: pinned.is_pinned(),
        "is_pinned(pageable)": lambda: pageable.is_pinned(),
        "device attr": lambda: pinned.device,
        "is_contiguous": lambda: pinned.is_contiguous(),
        "data_ptr": lambda: pinned.data_ptr(),
        "one view": lambda: slab[3],
        "empty [16, 3] cuda": lambda: torch.empty((16, 3), dtype=torch.int64, device=device),
        "from_numpy": lambda: torch.from_numpy(buf_np[:512].view(np.int64)),
        "np copyto 1.5MB": lambda: np.copyto(buf_np[:1572864], buf_np[1572864:3145728]),
        "np max int16 1.5MB": lambda: buf_np[:1572864].view(np.int16).max(),
        "np small min+max": lambda: (buf_np[:512].view(np.int64).min(), buf_np[:512].view(np.int64).max()),
        "g.cpu() 64 int64": lambda: g.cpu(),
        "isfinite.all gpu": lambda: bool(torch.isfinite(x).all()),
        "current_stream": lambda: torch.cuda.current_stream(device),
        "pure python 300": lambda: sum(i & 7 for i in range(300)),
    }


def table(cases: dict, wait, label: str) -> None:
    for name, fn in cases.items():
        fn()
        print(f"{label:10s} {name:22s} cold {cold(fn, wait):8.1f} us   hot {hot(fn):8.2f} us", flush=True)


def engine_process(device, cases: dict, wait) -> None:
    from drafter.bench import SPECS, build_engine, on_device, random_head, steady_state_call

    spec = SPECS["eagle3-8b"]
    head = random_head(spec, device, torch.bfloat16)
    engine = build_engine(head, spec, 3, [1, 16], 1024, device, "on")
    with torch.inference_mode():
        engine.graphs.capture()
    call = on_device(steady_state_call(engine, 16, 1024, seed=1), device)
    print(f"engine built: {len(gc.get_objects())} objects tracked by the collector", flush=True)
    cases = dict(cases, **{"trusted propose b16": lambda: engine.propose(**call, validate=False)})
    for label, setup in (("gc on", lambda: None), ("gc frozen", gc.freeze), ("gc off", gc.disable)):
        setup()
        table(cases, wait, label)
        print(f"{label:10s} collections so far: {[s['collections'] for s in gc.get_stats()]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", action="store_true", help="also inside an engine process (see the module doc)")
    args = p.parse_args()
    device = torch.device("cuda")
    x = torch.zeros(1024, device=device)

    def wait():
        x.add_(1)
        torch.cuda.synchronize()

    cases = op_cases(device)
    table(cases, wait, "bare")
    if args.engine:
        engine_process(device, cases, wait)


if __name__ == "__main__":
    main()
