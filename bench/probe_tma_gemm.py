"""Probe on a GPU host: can a TMA-fed kernel stream the step's weights faster at 16-64 rows?

    python bench/probe_tma_gemm.py --out DIR [--rows 16,32,64]

At 64 rows both cuBLAS and drafter's skinny kernel (pointer loads, cp.async) stream the Llama-8B
step weights at only 0.80-0.84 of copy bandwidth (bench/results/2026-11-24-h100-split-k-probe).
This times plain x @ W.T (no fused work) for each step weight, device microseconds from graph
replays over three weight copies, for:
  cublas   F.linear
  skinny   drafter's kernel with the planner's candidates
  tma      TensorDescriptor (TMA) loads of x and W, one program per column block
  tma_ws   the same with Triton's warp-specialised loop (a producer warp issues the loads)
  swap     TMA, W as the MMA's M side: acc [BLOCK_N, rows] = W_tile @ x.T
Writes DIR/probe_tma_gemm.json; prints the best of each per weight and row count.
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from drafter.tools.bench.grid import copy_bandwidth
from drafter.kernels.cuda_timing import graph_time_us
from drafter.kernels.skinny_gemm import GemmConfig, skinny_gemm
from drafter.kernels.weight_gemm import CANDIDATES

SHAPES = {"qkv": (6144, 8192), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (32000, 4096)}


@triton.jit
def tma_gemm_kernel(x_desc, w_desc, out_ptr, stride_out, m, N, K,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    STAGES: tl.constexpr, WARP_SPEC: tl.constexpr, SWAP: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES, warp_specialize=WARP_SPEC):
        x = x_desc.load([0, k0])  # [BLOCK_M, BLOCK_K]
        w = w_desc.load([n0, k0])  # [BLOCK_N, BLOCK_K]
        if SWAP:
            acc = tl.dot(w, x.T, acc)
        else:
            acc = tl.dot(x, w.T, acc)
    if SWAP:
        acc = acc.T
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    ok = (offs_m < m)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


def tma_gemm(x, w, out, block_n, block_k, warps, stages, warp_spec=False, swap=False):
    m, k = x.shape
    block_m = max(16, triton.next_power_of_2(m))
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(w, [block_n, block_k])

    def run():
        tma_gemm_kernel[(triton.cdiv(w.shape[0], block_n),)](
            x_desc, w_desc, out, out.stride(0), m, w.shape[0], k, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, STAGES=stages, WARP_SPEC=warp_spec, SWAP=swap, num_warps=warps)
    return run


TMA_CONFIGS = [  # (block_n, block_k, warps, stages), all within ~200 KB of shared memory at 64 rows
    (64, 128, 4, 4), (64, 128, 4, 6), (64, 64, 4, 8), (128, 64, 4, 4), (128, 64, 8, 4), (128, 64, 4, 6),
    (128, 128, 4, 4), (128, 128, 8, 3), (256, 64, 8, 3), (256, 64, 8, 4)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="64,32")
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s, triton {triton.__version__}", flush=True)
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9, "gemms": {}}
    errors = set()
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5 for _ in range(3)]
        floor = n * k * 2 / bw * 1e6
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device=device, dtype=torch.bfloat16) for _ in range(3)]
            ref = F.linear(x, copies[0]).float()
            times = {"cublas": graph_time_us(lambda i: F.linear(x, copies[i % 3]), calls=6)}
            bucket = max(16, triton.next_power_of_2(m))
            for c in CANDIDATES[bucket]:
                times[f"skinny {c.label}"] = graph_time_us(
                    lambda i, c=c: skinny_gemm(x, copies[i % 3], out=outs[i % 3], config=c), calls=6)
            for variant, ws, swap in (("tma", False, False), ("tma_ws", True, False), ("swap", False, True)):
                for bn, bk, wp, st in TMA_CONFIGS:
                    if swap and bn < 64:
                        continue
                    label = f"{variant} {bn}/{bk}/{wp}/{st}"
                    try:
                        runs = [tma_gemm(x, copies[i], outs[i], bn, bk, wp, st, ws, swap) for i in range(3)]
                        runs[0]()
                        torch.cuda.synchronize()
                        err = (outs[0].float() - ref).abs().max().item()
                        if err > 0.05 * ref.abs().max().item():
                            times[label] = float("inf")
                            print(f"  {label}: wrong result (max err {err:.3g})", flush=True)
                            continue
                        times[label] = graph_time_us(lambda i: runs[i % 3](), calls=6)
                    except Exception as e:  # noqa: BLE001 - a probe records what does not compile
                        times[label] = float("inf")
                        key = (variant, type(e).__name__)
                        if key not in errors:
                            errors.add(key)
                            print(f"  {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                            traceback.print_exc(limit=2)
            result["gemms"].setdefault(name, {"floor_us": floor, "rows": {}})["rows"][m] = times
            best = {}
            for label, us in times.items():
                kind = label.split()[0]
                if us < best.get(kind, (float("inf"), ""))[0]:
                    best[kind] = (us, label)
            print(f"{name:8} m={m:2}: floor {floor:6.1f} | " + " | ".join(
                f"{kind} {us:6.1f} ({floor / us:.2f}) [{label.split()[-1] if ' ' in label else ''}]"
                for kind, (us, label) in best.items()), flush=True)
            (out_dir / "probe_tma_gemm.json").write_text(json.dumps(result, indent=1))
        del copies


if __name__ == "__main__":
    main()
