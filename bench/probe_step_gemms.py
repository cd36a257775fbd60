"""Probe on a GPU host: the draft step's weight GEMMs through cuBLAS vs drafter's skinny GEMM
(block-size sweep), and what an L2 prefetch of the next weights buys.

    python bench/probe_step_gemms.py --out DIR

Writes DIR/probe.json and prints a table per shape.  EAGLE-3 / Llama-3.1-8B shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from drafter.bench import copy_bandwidth, time_events
from drafter.models.fused_kernels import silu_mul
from drafter.models.prefetch import launch_prefetch, prefetch_words
from drafter.models.skinny_gemm import GemmConfig, pick_config, skinny_gemm

SHAPES = {"qkv": (6144, 8192, "none"), "o": (4096, 4096, "none"), "gate_up": (28672, 4096, "silu"),
          "down": (4096, 14336, "residual"), "lm_head": (32000, 4096, "none")}
CONFIGS = [GemmConfig(bn, bk, w, s) for bn, bk, w, s in (
    (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 4), (32, 256, 4, 3), (32, 512, 4, 3),
    (32, 256, 8, 4), (64, 128, 4, 4), (64, 256, 4, 3), (64, 256, 8, 4), (64, 128, 4, 6), (128, 128, 8, 3),
    (16, 128, 4, 6), (32, 128, 4, 6))]


def med(fn, iters=30):
    return statistics.median(time_events(fn, iters, warmup=3))


def gemm_probe(dev, bw, log):
    rows = []
    for name, (n, k, epi) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(3)]
        for m in (1, 4, 16, 64):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            res = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
            it = iter(range(10 ** 9))

            def cublas():
                w = ws[next(it) % 3]
                if epi == "silu":
                    return silu_mul(F.linear(x, w))
                if epi == "residual":
                    return res.clone().addmm_(x, w.t())
                return F.linear(x, w)

            def cublas_gemm_only():
                return F.linear(x, ws[next(it) % 3])

            ref = cublas().float()
            t_cublas = med(cublas)
            t_gemm = med(cublas_gemm_only)
            best = None
            cfgs = CONFIGS + [pick_config(m, n // 2 if epi == "silu" else n, k, dev, 2 if epi == "silu" else 1)]
            for cfg in cfgs:
                try:
                    def ours(cfg=cfg):
                        return skinny_gemm(x, ws[next(it) % 3], residual=res if epi == "residual" else None,
                                           silu_mul=epi == "silu", config=cfg)
                    got = ours().float()
                    err = float((got - ref).norm() / ref.norm())
                    t = med(ours)
                except Exception as exc:  # noqa: BLE001 (a config that does not compile)
                    log(f"   {name} m={m} {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                row = {"gemm": name, "m": m, "cfg": cfg.__dict__, "us": t, "rel_err": err,
                       "frac_bw": n * k * 2 / (t * 1e-6) / bw, "picked": cfg is cfgs[-1]}
                rows.append(row)
                if best is None or t < best["us"]:
                    best = row
            picked = [r for r in rows if r["gemm"] == name and r["m"] == m and r["picked"]]
            rows.append({"gemm": name, "m": m, "cublas_us": t_cublas, "cublas_gemm_us": t_gemm,
                         "cublas_frac_bw": n * k * 2 / (t_gemm * 1e-6) / bw})
            log(f"{name:8} m={m:3} cuBLAS {t_cublas:7.1f} us (gemm {t_gemm:6.1f}, {n * k * 2 / (t_gemm * 1e-6) / bw:.2f} bw)"
                f" | ours best {best['us']:7.1f} us ({best['frac_bw']:.2f} bw, err {best['rel_err']:.1e}) {best['cfg']}"
                f" | picked {picked[0]['us'] if picked else float('nan'):7.1f}")
        del ws
        torch.cuda.empty_cache()
    return rows


def prefetch_probe(dev, bw, log):
    out = {}
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    sink = torch.zeros(1, dtype=torch.int32, device=dev)
    w_o = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    w_qkv = torch.randn(6144, 8192, device=dev, dtype=torch.bfloat16)
    words = prefetch_words(w_o, 1 << 40)
    for programs in (33, 66, 132, 264):
        t = med(lambda: launch_prefetch(words, sink, programs))
        out[f"prefetch_o_us_p{programs}"] = t
        log(f"prefetch 33.5 MB with {programs} programs: {t:.1f} us ({words.numel() * 4 / (t * 1e-6) / 1e9:.0f} GB/s)")
    for m in (1, 16, 64):
        x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
        xq = torch.randn(m, 8192, device=dev, dtype=torch.bfloat16)
        for label, w, xx, pre_bytes in (("o", w_o, x, 1 << 40), ("qkv_24MB", w_qkv, xq, 24 << 20),
                                        ("qkv_40MB", w_qkv, xq, 40 << 20)):
            pw = prefetch_words(w, pre_bytes)
            cold, warm = [], []
            for _ in range(20):
                flush.fill_(1)
                cold.append(time_events(lambda: F.linear(xx, w), 1, warmup=0)[0])
                flush.fill_(2)
                launch_prefetch(pw, sink, 132)
                warm.append(time_events(lambda: F.linear(xx, w), 1, warmup=0)[0])
            out[f"{label}_m{m}"] = {"cold_us": statistics.median(cold), "after_prefetch_us": statistics.median(warm)}
            log(f"{label:9} m={m:3}: cuBLAS cold {statistics.median(cold):6.1f} us, after prefetch "
                f"{statistics.median(warm):6.1f} us")
    # in a graph: 8 latency-bound kernels (~attention's window) then the o GEMM, with and without a
    # side-stream prefetch of the o weights forked before them; a 256 MB fill first evicts L2
    small = [torch.randn(64, 4096, device=dev) for _ in range(9)]
    for m in (1, 16, 64):
        x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
        side = torch.cuda.Stream()

        def body(prefetch: bool, gemm: bool = True):
            flush.fill_(3)
            if prefetch:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    launch_prefetch(words, sink, 132)
            for i in range(8):
                small[i + 1].add_(small[i], alpha=0.5)
            if gemm:
                F.linear(x, w_o)
            if prefetch:
                torch.cuda.current_stream().wait_stream(side)

        res = {}
        for label, kw in (("flush_small", dict(prefetch=False, gemm=False)), ("no_prefetch", dict(prefetch=False)),
                          ("prefetch", dict(prefetch=True))):
            body(**kw)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body(**kw)
            res[label] = med(g.replay, 50)
        out[f"graph_o_m{m}"] = res
        log(f"graph m={m:3}: fill+8 small {res['flush_small']:.1f} us; + o GEMM {res['no_prefetch']:.1f} us; "
            f"with prefetch {res['prefetch']:.1f} us -> GEMM share {res['no_prefetch'] - res['flush_small']:.1f}"
            f" vs {res['prefetch'] - res['flush_small']:.1f} us")
    return out


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
    result["prefetch"] = prefetch_probe(dev, bw, log)
    if not args.skip_gemm:
        result["gemm"] = gemm_probe(dev, bw, log)
    (out / "probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
