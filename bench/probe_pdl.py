"""Probe on a GPU host: the draft loop with and without programmatic dependent launch (drafter.pdl),
and with how many weight tiles each skinny-GEMM program prefetches into L2 before it waits.

    python bench/probe_pdl.py --out DIR [--k 3 --batches 1,16,64 --contexts 1024,8192]

One EAGLE-3 8B engine (planned with PDL on); per variant its graphs are captured afresh and the
loop graph of each batch is timed against the floor of `drafter bench`.  The drafts of every
variant must equal those of the plain launches (same kernels, same inputs).  Writes
DIR/probe_pdl.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
from dataclasses import replace
from pathlib import Path

import torch

from drafter.bench import (SPECS, _ints, build_engine, copy_bandwidth, floors, on_device, random_head,
                           steady_state_call, time_events, weight_bytes)
from drafter.graphs import GraphRunner
from drafter.models.weight_gemm import WeightGemm

VARIANTS = (("plain", "0", None), ("pdl", "1", 0), ("pdl+pf1", "1", 1), ("pdl+pf2", "1", 2),
            ("pdl+pf4", "1", 4))


def set_prefetch(head, tiles: int) -> None:
    for gemm in (v for m in head.modules() for v in vars(m).values() if isinstance(v, WeightGemm)):
        gemm.configs = {b: replace(c, prefetch=tiles) for b, c in gemm.configs.items()}
        gemm.scaled_configs = {b: replace(c, prefetch=tiles) for b, c in gemm.scaled_configs.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batches", type=_ints, default=[1, 16, 64])
    p.add_argument("--contexts", type=_ints, default=[1024, 8192])
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    spec = SPECS["eagle3-8b"]
    head = random_head(spec, device, torch.bfloat16)
    wbytes = weight_bytes(head, spec)
    engine = build_engine(head, spec, args.k, args.batches, max(args.contexts), device)
    calls = {(b, ctx): on_device(steady_state_call(engine, b, ctx, seed=b + ctx), device)
             for b in args.batches for ctx in args.contexts}
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9, "k": args.k, "rows": []}
    reference = {}
    for name, env, tiles in VARIANTS:
        os.environ["DRAFTER_PDL"] = env
        if tiles is not None:
            set_prefetch(head, tiles)
        engine.graphs = None
        gc.collect()
        engine.graphs = GraphRunner(engine)
        with torch.inference_mode():
            engine.graphs.capture()
            for (b, ctx), call in calls.items():
                drafts = engine.propose(**call, validate=False).draft_token_ids.cpu()
                same = reference.setdefault((b, ctx), drafts).equal(drafts)
                engine.propose(**call, validate=False)  # the loop graph now reads this call's buffers
                loop = statistics.median(time_events(engine.graphs.loop_graphs[b], args.iters, sync_each=False))
                prop = statistics.median(time_events(lambda: engine.propose(**call, validate=False), args.iters))
                f = floors(wbytes, spec, b, ctx, args.k, bw)
                row = {"variant": name, "batch": b, "ctx": ctx, "loop_us": loop, "propose_us": prop,
                       "ratio_loop": loop / f["loop_us"], "ratio_propose": prop / f["propose_us"],
                       "drafts_equal_plain": same}
                result["rows"].append(row)
                print(f"{name:8} b={b:3} ctx={ctx:5}: loop {loop:7.1f} us ({row['ratio_loop']:.3f} of floor), "
                      f"propose {prop:7.1f} ({row['ratio_propose']:.3f}), drafts equal: {same}", flush=True)
    (out / "probe_pdl.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
