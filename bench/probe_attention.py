"""Probe on a GPU host: the decode attention kernel's tile / pipeline shapes and split targets.

    python bench/probe_attention.py --out DIR [--contexts 1024 --batches 1,16,32,64]

Times the decode-shaped paged attention (Llama-8B heads: 32 query, 8 KV, head_dim 128, pages of
16) alone in CUDA graphs, rotating over 3 KV caches so nothing is served from L2: the backend's
own choice ("auto") and forced AttentionLaunch shapes x target programs per SM.  Writes
DIR/probe_attention.json and prints the best shape per batch.  TritonBackend's defaults
(SMALL_GRID_LAUNCH, MID_GRID_LAUNCH, PROGRAMS_PER_SM) come from this probe.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from drafter.attention.triton_backend import AttentionLaunch, TritonBackend
from drafter.tools.bench.grid import BLOCK_SIZE, copy_bandwidth, decode_attention_case
from drafter.kernels.cuda_timing import graph_time_us


def sweep(args, bw, log) -> list[dict]:
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    shapes = [(ctx, b) for ctx in args.contexts for b in args.batches]
    launches = [AttentionLaunch(bn, w, s) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
    for ctx, b in shapes:
        per_req = -(-(ctx + 8) // BLOCK_SIZE)
        caches, meta, q, kv_bytes = decode_attention_case(device, ctx, b, copies=3)
        auto = TritonBackend()
        auto_us = graph_time_us(lambda i: auto.attend(q, caches[i % 3], meta, None), calls=6)
        rows.append({"ctx": ctx, "batch": b, "auto": True, "us": auto_us,
                     "fraction_of_copy_bw": kv_bytes / (auto_us * 1e-6) / bw})
        best = None
        for launch in launches:
            for mult in (2, 4, 8):
                backend = TritonBackend(target_programs=mult * sms, launch=launch)
                try:
                    us = graph_time_us(lambda i: backend.attend(q, caches[i % 3], meta, None), calls=6)
                except Exception as exc:
                    log(f"  attention ctx={ctx} b={b} {launch} x{mult}: failed {exc!r}"[:300])
                    continue
                row = {"ctx": ctx, "batch": b, "block_n": launch.block_n, "num_warps": launch.num_warps,
                       "num_stages": launch.num_stages, "programs_per_sm": mult, "us": us,
                       "splits": backend._splits(device, b * 8, per_req * BLOCK_SIZE, launch),
                       "fraction_of_copy_bw": kv_bytes / (us * 1e-6) / bw}
                rows.append(row)
                if best is None or us < best["us"]:
                    best = row
        log(f"  attention ctx={ctx:5} b={b:3}: auto {auto_us:6.1f} us "
            f"({kv_bytes / (auto_us * 1e-6) / bw:.2f} bw) | best forced {best['us']:6.1f} us "
            f"({best['fraction_of_copy_bw']:.2f} bw) block_n={best['block_n']} warps={best['num_warps']} "
            f"stages={best['num_stages']} x{best['programs_per_sm']} splits={best['splits']}")
        del caches
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--contexts", default="1024")
    p.add_argument("--batches", default="1,16,32,64")
    args = p.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    log(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s")
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9, "args": vars(args),
              "attention": sweep(args, bw, log)}
    (out / "probe_attention.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
