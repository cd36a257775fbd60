"""Host cost of single torch / numpy / CUDA operations on a GPU host, timed right after the host
waited for the GPU (as inside a propose call: "cold") and in a tight loop ("hot"), median us.
The service's per-call path is made of these.

    python bench/probe_host_ops.py
"""
import time, statistics, torch, numpy as np
dev = torch.device("cuda")
buf = torch.empty(1 << 22, dtype=torch.uint8, pin_memory=True)
buf_np = buf.numpy()
pinned = torch.from_numpy(buf_np[:512].view(np.int64))
pageable = torch.zeros(64, dtype=torch.int64)
g = torch.zeros(64, dtype=torch.int64, device=dev)
x = torch.zeros(64, 12288, dtype=torch.bfloat16, device=dev)
def cold(fn, n=300):
    out = []
    for _ in range(n):
        x.add_(1); torch.cuda.synchronize()  # as a caller: right after waiting for the GPU
        t0 = time.perf_counter(); fn(); out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)
def hot(fn, n=2000):
    t0 = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - t0) / n * 1e6
cases = {
 "is_pinned(pinned)": lambda: pinned.is_pinned(),
 "is_pinned(pageable)": lambda: pageable.is_pinned(),
 "device attr": lambda: pinned.device,
 "is_contiguous": lambda: pinned.is_contiguous(),
 "data_ptr": lambda: pinned.data_ptr(),
 "from_numpy": lambda: torch.from_numpy(buf_np[:512].view(np.int64)),
 "np copyto 1.5MB": lambda: np.copyto(buf_np[:1572864], buf_np[1572864:3145728]),
 "np max int16 1.5MB": lambda: buf_np[:1572864].view(np.int16).max(),
 "np small min+max": lambda: (buf_np[:512].view(np.int64).min(), buf_np[:512].view(np.int64).max()),
 "g.cpu() 64 int64": lambda: g.cpu(),
 "isfinite.all gpu": lambda: bool(torch.isfinite(x).all()),
 "current_stream": lambda: torch.cuda.current_stream(dev),
 "pure python 300": lambda: sum(i & 7 for i in range(300)),
}
for name, fn in cases.items():
    fn()
    print(f"{name:24s} cold {cold(fn):8.1f} us   hot {hot(fn):8.2f} us", flush=True)
