"""Probe on a GPU host: the draft step's weight GEMMs through cuBLAS vs drafter's skinny GEMM
(block-size sweep).  (An L2 prefetch of the next weights on a side stream was probed here on
2026-11-22 and bought nothing on an H100: bench/results/README.md.)

    python bench/probe_step_gemms.py --out DIR

Writes DIR/probe.json and prints a table per shape.  EAGLE-3 / Llama-3.1-8B shapes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from drafter.tools.bench.grid import copy_bandwidth
from drafter.kernels.cuda_timing import graph_time_us
from drafter.kernels.fused_kernels import silu_mul
from drafter.kernels.skinny_gemm import GemmConfig, pick_config, skinny_gemm

SHAPES = {"qkv": (6144, 8192, "none"), "o": (4096, 4096, "none"), "gate_up": (28672, 4096, "silu"),
          "down": (4096, 14336, "residual"), "lm_head": (32000, 4096, "none")}
CONFIGS = [GemmConfig(bn, bk, w, s) for bn, bk, w, s in (
    (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 4), (32, 256, 4, 3), (32, 512, 4, 3),
    (32, 256, 8, 4), (64, 128, 4, 4), (64, 256, 4, 3), (64, 256, 8, 4), (64, 128, 4, 6), (128, 128, 8, 3),
    (16, 128, 4, 6), (32, 128, 4, 6))]


def gemm_probe(dev, bw, log):
    """Device time per call from graph replays (graph_time_us), weights rotated over 3 copies."""
    rows = []
    for name, (n, k, epi) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(3)]
        for m in (1, 4, 16, 64):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            res = torch.randn(m, n // 2 if epi == "silu" else n, device=dev, dtype=torch.bfloat16)

            def cublas(i):
                w = ws[i % 3]
                if epi == "silu":
                    return silu_mul(F.linear(x, w))
                if epi == "residual":
                    return res.clone().addmm_(x, w.t())
                return F.linear(x, w)

            ref = cublas(0).float()
            t_cublas = graph_time_us(cublas)
            t_gemm = graph_time_us(lambda i: F.linear(x, ws[i % 3]))
            best = None
            picked = pick_config(m, n // 2 if epi == "silu" else n, k, dev, 2 if epi == "silu" else 1)
            for cfg in CONFIGS + [picked]:
                def ours(i, cfg=cfg):
                    return skinny_gemm(x, ws[i % 3], residual=res.clone() if epi == "residual" else None,
                                       silu_mul=epi == "silu", config=cfg)
                try:
                    err = float((ours(0).float() - ref).norm() / ref.norm())
                    t = graph_time_us(ours)
                except Exception as exc:  # noqa: BLE001 (a config that does not fit)
                    log(f"   {name} m={m} {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                row = {"gemm": name, "m": m, "cfg": cfg.__dict__, "us": t, "rel_err": err,
                       "frac_bw": n * k * 2 / (t * 1e-6) / bw, "picked": cfg is picked}
                rows.append(row)
                if best is None or t < best["us"]:
                    best = row
            t_picked = next((r["us"] for r in rows if r["gemm"] == name and r["m"] == m and r["picked"]), float("nan"))
            rows.append({"gemm": name, "m": m, "cublas_us": t_cublas, "cublas_gemm_us": t_gemm,
                         "cublas_frac_bw": n * k * 2 / (t_gemm * 1e-6) / bw})
            log(f"{name:8} m={m:3} cuBLAS {t_cublas:6.1f} us (GEMM alone {t_gemm:6.1f}, {n * k * 2 / (t_gemm * 1e-6) / bw:.2f}"
                f" of copy bw) | skinny best {best['us']:6.1f} ({best['frac_bw']:.2f}, err {best['rel_err']:.1e})"
                f" {tuple(best['cfg'].values())} | picked {t_picked:6.1f}")
        del ws
        torch.cuda.empty_cache()
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--skip-gemm", action="store_true")
    args = p.parse_args()
    dev = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    bw = copy_bandwidth(dev)
    log(f"{torch.cuda.get_device_name()} copy {bw / 1e9:.0f} GB/s")
    result = {"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9}
    if not args.skip_gemm:
        result["gemm"] = gemm_probe(dev, bw, log)
    (out / "probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
