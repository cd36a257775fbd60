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
    from drafter.tools.bench.grid import SPECS, build_engine, on_device, random_head, steady_state_call

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


def staging(mb: float, threads: tuple[int, ...] = (1, 2, 4, 8, 16)) -> None:
    """What the service does to each call's hidden states on the host: copy them out of the
    message into pinned memory and check them (two max passes over their bits), with numpy (one
    thread) and with torch at several intra-op thread counts; the sources cycle through 256 MB so
    that each copy reads memory not in cache, as a fresh message's."""
    n = int(mb * 2**20) // 2
    sources = torch.empty((max(2, 2**28 // (2 * n)), n), dtype=torch.int16)
    sources.random_(-2**15, 2**15)
    dst = torch.empty(n, dtype=torch.int16, pin_memory=torch.cuda.is_available())
    src_np, dst_np = sources.numpy(), dst.numpy()
    turn = iter(range(10**9))

    def cycled(fn, reps: int = 200) -> float:
        out = []
        for _ in range(reps):
            i = next(turn) % len(sources)
            t0 = time.perf_counter()
            fn(i)
            out.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(out)

    print(f"staging {mb} MB: numpy copy {cycled(lambda i: np.copyto(dst_np, src_np[i])):7.1f} us, "
          f"numpy copy + 2 max {cycled(lambda i: (np.copyto(dst_np, src_np[i]), dst_np.max(), dst_np.view(np.uint16).max())):7.1f} us",
          flush=True)
    scratch = torch.empty_like(dst)

    def exponent_max(i):  # bf16: some element is NaN / inf iff its exponent bits are all set
        dst.copy_(sources[i])
        return int(torch.bitwise_and(dst, 0x7F80, out=scratch).max()) == 0x7F80

    before = torch.get_num_threads()
    for t in threads:
        torch.set_num_threads(t)
        copy = cycled(lambda i: dst.copy_(sources[i]))
        both = cycled(exponent_max)
        print(f"staging {mb} MB: torch threads {t:2d} copy {copy:7.1f} us, copy + masked max {both:7.1f} us", flush=True)
    torch.set_num_threads(before)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", action="store_true", help="also inside an engine process (see the module doc)")
    p.add_argument("--staging", action="store_true", help="only the hidden states' staging (see staging())")
    args = p.parse_args()
    if args.staging:
        for mb in (1.5, 6.0):
            staging(mb)
        return
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
