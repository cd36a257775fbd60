"""Probe on a GPU host: programmatic dependent launch (drafter.pdl) and L2 weight prefetch in the
draft step, and the decode attention kernel's tile / pipeline shapes.

    python bench/probe_pdl.py --out DIR [--batches 1,4,16,32,64 --ctx 1024 --k 3]

Part 1 builds one EAGLE-3 / Llama-3.1-8B engine (random weights) and, per launch variant,
re-captures its graphs and times the draft-loop graph (decode steps) and the first-pass graph
by back-to-back replays, against the same floor as `drafter bench`; every variant's drafts must
equal the plain-launch drafts.  Part 2 times the decode attention kernel alone in CUDA graphs
(rotating over 3 KV caches) for several AttentionLaunch shapes and split targets.
Writes DIR/probe_pdl.json; prints a table per part.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from drafter.attention.metadata import AttentionMetadata
from drafter.attention.triton_backend import AttentionLaunch, TritonBackend
from drafter.bench import (BLOCK_SIZE, SPECS, as_inputs, build_engine, copy_bandwidth, floors, random_head,
                           steady_state_call, time_events, weight_bytes)
from drafter.cuda_timing import graph_time_us
from drafter.graphs import GraphRunner
from drafter.models.weight_gemm import WeightGemm
from drafter.pdl import allow_next_kernel, wait_previous_kernel

MB = 1 << 20
VARIANTS = {  # name -> (pdl, total prefetch bytes per GEMM)
    "plain": (False, {}),
    "pdl": (True, {}),
    "pdl+pf-small": (True, {"qkv": 4 * MB, "o": 4 * MB, "gate_up": 2 * MB, "down": 2 * MB, "lm_head": 2 * MB}),
    "pdl+pf-o": (True, {"o": 16 * MB}),
}


def set_launch(engine, pdl: bool, prefetch: dict[str, int]) -> None:
    """Switch an engine's fused head and backend to a launch variant (graphs must be re-captured)."""
    head = engine.head
    engine.backend.pdl = pdl
    for m in head.modules():
        m.pdl = pdl
        for role, attr in (("qkv", "qkv_gemm"), ("o", "o_gemm"), ("gate_up", "gate_up_gemm"),
                           ("down", "down_gemm"), ("lm_head", "lm_head_gemm")):
            g = getattr(m, attr, None)
            if isinstance(g, WeightGemm):
                g.pdl = pdl
                g.prefetch_bytes = prefetch.get(role, 0) if pdl else 0


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _spin_kernel(out_ptr, ns, PDL: tl.constexpr):
    allow_next_kernel(PDL)
    t0 = _now()
    t = t0
    while t - t0 < ns:
        t = _now()
    tl.store(out_ptr, t)


@triton.jit
def _follower_kernel(out_ptr, PDL: tl.constexpr):
    tl.store(out_ptr + 1, _now())  # before the wait: when this kernel started
    wait_previous_kernel(PDL)
    tl.store(out_ptr + 2, _now())


def part0(log) -> dict:
    """Does a PDL launch start before the kernel before it ends, eagerly and inside a CUDA graph?"""
    out = torch.zeros(3, dtype=torch.int64, device="cuda")

    def pair():
        _spin_kernel[(1,)](out, 50_000, PDL=True, launch_pdl=True)
        _follower_kernel[(1,)](out, PDL=True, launch_pdl=True)

    pair()
    torch.cuda.synchronize()
    eager = out.tolist()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pair()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    captured = out.tolist()
    res = {"eager_start_before_end_ns": eager[0] - eager[1], "graph_start_before_end_ns": captured[0] - captured[1],
           "eager_wait_after_end_ns": eager[2] - eager[0], "graph_wait_after_end_ns": captured[2] - captured[0]}
    log(f"PDL: follower started {res['eager_start_before_end_ns'] / 1e3:.1f} us before the spinner ended (eager), "
        f"{res['graph_start_before_end_ns'] / 1e3:.1f} us (graph); its wait returned "
        f"{res['eager_wait_after_end_ns'] / 1e3:.1f} / {res['graph_wait_after_end_ns'] / 1e3:.1f} us after")
    return res


def part1(head, spec, args, bw, log, save) -> list[dict]:
    device = torch.device("cuda")
    wbytes = weight_bytes(head, spec)
    engine = build_engine(head, spec, args.k, args.batches, max(args.contexts), device)
    rows, reference = [], {}
    kv0 = [t.clone() for t in engine.kv.layers]  # every variant's first call sees the same KV
    for name, (pdl, prefetch) in VARIANTS.items():
        set_launch(engine, pdl, prefetch)
        engine.graphs = None
        gc.collect()
        torch.cuda.empty_cache()
        runner = GraphRunner(engine)
        engine.graphs = runner
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                runner.capture()
        except Exception as exc:  # a variant that does not compile or capture: record and go on
            log(f"{name}: capture failed: {exc!r}"[:400])
            rows.append({"variant": name, "error": repr(exc)[:400]})
            continue
        log(f"{name}: captured in {time.perf_counter() - t0:.1f}s")
        for ctx in args.contexts:
            for b in args.batches:
                call = steady_state_call(engine, b, ctx, seed=b * 7 + ctx)
                inp = as_inputs(call, device)
                t_pad = b * (args.k + 1)
                for t, saved in zip(engine.kv.layers, kv0):
                    t.copy_(saved)
                with torch.inference_mode():
                    ids = engine._propose_validated(inp, False, False, None, None).draft_token_ids.cpu()
                    same = None
                    if (ctx, b) in reference:
                        same = bool(torch.equal(ids, reference[(ctx, b)]))
                    else:
                        reference[(ctx, b)] = ids
                    first = statistics.median(time_events(runner.first_graphs[t_pad], args.iters, sync_each=False))
                    loop = statistics.median(time_events(runner.loop_graphs[b], args.iters, sync_each=False))
                f = floors(wbytes, spec, b, ctx, args.k, bw)
                row = {"variant": name, "ctx": ctx, "batch": b, "first_us": first, "loop_us": loop,
                       "ratio_loop": loop / f["loop_us"], "ratio_device": (first + loop) / f["propose_us"],
                       "same_drafts_as_plain": same}
                rows.append(row)
                log(f"  {name:14} ctx={ctx:5} b={b:3}: loop {loop:7.1f} us ({row['ratio_loop']:.3f} of floor), "
                    f"first {first:6.1f} us, device {row['ratio_device']:.3f}, same drafts {same}")
        save(rows)  # what is measured survives a timeout
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def part2(args, bw, log) -> list[dict]:
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    shapes = [(ctx, b) for ctx in args.contexts for b in (1, 16, 32, 64)]
    launches = [AttentionLaunch(bn, 4, s) for bn in (64, 128) for s in (3, 4)]
    for ctx, b in shapes:
        per_req = -(-(ctx + 8) // BLOCK_SIZE)
        caches = [torch.randn(2, b * per_req + 1, BLOCK_SIZE, 8, 128, device=device, dtype=torch.bfloat16)
                  for _ in range(3)]
        table = torch.randperm(b * per_req, device=device).view(b, per_req).int()
        meta = AttentionMetadata(torch.arange(b + 1, device=device, dtype=torch.int32),
                                 torch.full((b,), ctx, device=device, dtype=torch.int32), table,
                                 torch.full((b,), -1, device=device, dtype=torch.long), BLOCK_SIZE)
        q = torch.randn(b, 32, 128, device=device, dtype=torch.bfloat16)
        kv_bytes = b * ctx * 2 * 8 * 128 * 2
        auto = TritonBackend()
        auto_us = graph_time_us(lambda i: auto.attend(q, caches[i % 3], meta, None), calls=6)
        rows.append({"ctx": ctx, "batch": b, "auto": True, "us": auto_us, "fraction_of_copy_bw": kv_bytes / (auto_us * 1e-6) / bw})
        best = None
        for launch in launches:
            for mult in (4, 8, 16):
                backend = TritonBackend(target_programs=mult * sms, launch=launch)
                try:
                    us = graph_time_us(lambda i: backend.attend(q, caches[i % 3], meta, None), calls=6)
                except Exception as exc:
                    log(f"  attention ctx={ctx} b={b} {launch} x{mult}: failed {exc!r}"[:300])
                    continue
                row = {"ctx": ctx, "batch": b, "block_n": launch.block_n, "num_warps": launch.num_warps,
                       "num_stages": launch.num_stages, "programs_per_sm": mult, "us": us,
                       "splits": backend._splits(device, b * 8, per_req * BLOCK_SIZE, launch.block_n),
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
    p.add_argument("--batches", default="1,4,16,32,64")
    p.add_argument("--contexts", default="1024")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--skip", default="", help="parts to skip: 0, 1, 2")
    args = p.parse_args()
    args.batches = [int(x) for x in args.batches.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    log(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s")
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9, "args": vars(args)}
    if "0" not in args.skip:
        try:
            result["pdl_active"] = part0(log)
        except Exception as exc:  # the probe itself may not compile: record it
            log(f"PDL probe failed: {exc!r}"[:500])
    if "1" not in args.skip:
        head = random_head(SPECS["eagle3-8b"], device, torch.bfloat16)
        def save(rows):
            result["launch"] = rows
            (out / "probe_pdl.json").write_text(json.dumps(result, indent=1))

        save(part1(head, SPECS["eagle3-8b"], args, bw, log, save))
        del head
        torch.cuda.empty_cache()
    if "2" not in args.skip:
        result["attention"] = part2(args, bw, log)
    (out / "probe_pdl.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
