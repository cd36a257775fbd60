"""Probe on a GPU host: what plan_gemm measures for each weight GEMM of the EAGLE-3 / Llama-3.1-8B
step, over the planner's candidates plus extra skinny-kernel configurations.

    python bench/probe_plan.py --out DIR

Each time is one call as the layer runs it (epilogue, norm and argmax work included), device
microseconds from graph replays over three weight copies (drafter.kernels.weight_gemm.plan_gemm).
Writes DIR/probe_plan.json and prints, per weight and row bucket, cuBLAS, the best candidate and
the floor (weight bytes / copy bandwidth).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from drafter.tools.bench.grid import copy_bandwidth
from drafter.kernels.skinny_gemm import GemmConfig
from drafter.kernels.weight_gemm import CANDIDATES, plan_gemm

SHAPES = {  # name: (rows of the weight, K, plan_gemm's fused work)
    "qkv": (6144, 8192, {}), "o": (4096, 4096, {"residual": True}),
    "gate_up": (28672, 4096, {"silu_mul": True, "normed": True}), "down": (4096, 14336, {"residual": True}),
    "lm_head": (32000, 4096, {"normed": True, "argmax": True}),
}
EXTRA = {  # a few more than the planner times: 8-warp and 64-key tiles with TMA loads
    16: (GemmConfig(128, 128, 8, 4, swap=True, tma=True),),
    32: (GemmConfig(64, 128, 4, 6, tma=True), GemmConfig(128, 64, 8, 4, swap=True, tma=True)),
    64: (GemmConfig(128, 64, 8, 4), GemmConfig(128, 64, 8, 4, tma=True), GemmConfig(128, 128, 8, 3, swap=True, tma=True)),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s", flush=True)
    candidates = {b: CANDIDATES[b] + EXTRA[b] for b in CANDIDATES}
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9, "gemms": {}}
    for name, (rows, k, work) in SHAPES.items():
        w = torch.randn(rows, k, device=device, dtype=torch.bfloat16) * k ** -0.5
        timings = {}
        plan_gemm(w, timings=timings, candidates=candidates, **work)
        floor = rows * k * 2 / bw * 1e6
        result["gemms"][name] = {"floor_us": floor, "timings_us": {
            b: {c if isinstance(c, str) else c.label: us
                for c, us in t.items()} for b, t in timings.items()}}
        for b, t in result["gemms"][name]["timings_us"].items():
            best = min((us, c) for c, us in t.items() if c != "cublas")
            ranked = sorted(t.items(), key=lambda kv: kv[1])[:5]
            print(f"{name:8} m<={b:2}: floor {floor:6.1f} | cuBLAS {t['cublas']:6.1f} | best skinny {best[0]:6.1f} "
                  f"({best[1]}) | top: " + ", ".join(f"{c} {us:.1f}" for c, us in ranked), flush=True)
        del w
        (out / "probe_plan.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
