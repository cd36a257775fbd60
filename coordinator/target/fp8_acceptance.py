"""What --weights fp8 costs in acceptance: the trained tiny pair, greedy speculation, per draft position.

    python -m coordinator.target.fp8_acceptance --out bench/results/2026-11-25-fp8-acceptance

Trains (or reuses, under --work) the target + head pair of coordinator.target.distill for each
method, then runs the reference target engine (coordinator.target.engine) with the in-process drafter
twice over the same greedy requests: the head as its checkpoint has it (float32 on this CPU: the
"bf16" setting keeps the checkpoint's values) and the same head with its GEMM weights quantised to
per-channel FP8 (drafter.models.fp8.quantize_head, what EngineConfig.weights="fp8" does at load).
Both runs must emit the no-speculation outputs exactly (verification is lossless); what changes is
how many drafts the target accepts.  Writes results.json and table.md (date, host, command).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

from coordinator.circuit import BreakerConfig
from coordinator.inprocess import InProcessTransport
from coordinator.remote_proposer import ProposerConfig, RemoteProposer
from coordinator.routing import Router, StaticEndpoints
from coordinator.target.distill import DistillConfig, train_pair
from coordinator.target.engine import TargetConfig, TargetEngine
from coordinator.target.request import random_requests
from drafter.models.fp8 import quantize_head

WEIGHTS = ("bf16", "fp8")


def run_target(pair: Path, method: str, aux: tuple[int, ...], k: int, requests, weights: str | None):
    """One pass of the target engine over `requests`; weights None = no speculation.
    Returns (outputs by request id, the engine's stats or None)."""
    cfg = TargetConfig(str(pair / "target"), method=method, aux_layer_ids=aux if method == "eagle3" else (),
                       num_speculative_tokens=k if weights else 0, max_model_len=256, max_num_seqs=8,
                       num_blocks=512)
    engine = TargetEngine(cfg)
    if weights:
        transport = InProcessTransport(pair / "head", pair / "target", method)
        if weights == "fp8":
            quantize_head(transport.head)  # shared by every session engine the transport builds
        proposer = RemoteProposer(engine.session_spec("fp8-acceptance"),
                                  router=Router(StaticEndpoints(["inprocess://drafter:0"])), key="fp8/dp0",
                                  connect=lambda ep: transport,
                                  config=ProposerConfig(deadline_s=600, breaker=BreakerConfig(failure_threshold=1000)))
        proposer.start()
        engine.proposer = proposer
    for r in requests:
        engine.add(r)
    return engine.run(), (engine.stats if weights else None)


def measure(pair: Path, method: str, aux: tuple[int, ...], k: int, num_requests: int, max_new_tokens: int,
            seed: int, vocab: int, log) -> dict:
    """The acceptance of each weight setting on the same requests, checked lossless against no speculation."""
    requests = random_requests(num_requests, vocab_size=vocab, max_new_tokens=max_new_tokens, seed=seed)
    base, _ = run_target(pair, method, aux, k, requests, None)
    out = {"method": method, "k": k, "requests": num_requests, "max_new_tokens": max_new_tokens, "seed": seed}
    for weights in WEIGHTS:
        t0 = time.perf_counter()
        outputs, stats = run_target(pair, method, aux, k, requests, weights)
        if outputs != base:
            raise SystemExit(f"{method} {weights}: speculative outputs differ from plain decoding (not lossless)")
        out[weights] = {"acceptance_length": stats.acceptance_length,
                        "acceptance_by_position": stats.acceptance_by_position,
                        "proposed": list(stats.proposed), "accepted": list(stats.accepted),
                        "verify_steps": stats.verify_steps, "seconds": time.perf_counter() - t0}
        log(f"{method} {weights}: acceptance length {stats.acceptance_length:.3f}, per position "
            f"{[round(a, 3) for a in stats.acceptance_by_position]} ({time.perf_counter() - t0:.0f} s)")
    return out


def table(results: list[dict], meta: dict) -> str:
    lines = [f"# --weights fp8: acceptance on the trained tiny pair ({meta['date']})", "",
             f"Command: `{meta['command']}`  ", f"Host: {meta['host']}, torch {meta['torch']}, CPU (float32 "
             "activations; the bf16 rows keep the checkpoint's weight values).  ",
             "Greedy requests (random prompts), reference target engine, in-process drafter; both settings "
             "emitted exactly the no-speculation outputs.", "",
             "| method | k | weights | acceptance length | accepted / proposed per draft position |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        for w in WEIGHTS:
            s = r[w]
            per = ", ".join(f"{a / p:.3f} ({a}/{p})" if p else "-" for a, p in zip(s["accepted"], s["proposed"]))
            lines.append(f"| {r['method']} | {r['k']} | {w} | {s['acceptance_length']:.3f} | {per} |")
        d = r["fp8"]["acceptance_length"] - r["bf16"]["acceptance_length"]
        pos = ", ".join(f"{f - b:+.3f}" for f, b in zip(r["fp8"]["acceptance_by_position"],
                                                       r["bf16"]["acceptance_by_position"]))
        lines.append(f"| {r['method']} | {r['k']} | fp8 - bf16 | {d:+.3f} | {pos} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m coordinator.target.fp8_acceptance", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json and table.md")
    p.add_argument("--work", default="/tmp/drafter-fp8-acceptance", help="where the trained pairs are written "
                                                                         "(reused when present)")
    p.add_argument("--methods", default="eagle3,eagle", help="comma-separated, from eagle3, eagle [eagle3,eagle]")
    p.add_argument("--k", type=int, default=3, help="draft length [3]")
    p.add_argument("--requests", type=int, default=32, help="greedy requests [32]")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per request [48]")
    p.add_argument("--seed", type=int, default=11, help="seed of the prompts [11]")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # tiny matmuls: one thread beats two that fight over the cores
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    results = []
    for method in args.methods.split(","):
        cfg = DistillConfig(method=method)
        pair = Path(args.work) / f"pair-{method}"
        report = train_pair(pair, cfg)  # idempotent: reuses a finished pair
        log(f"{method}: trained pair at {pair}, held-out expected acceptance length "
            f"{report.expected_acceptance_length:.3f}")
        results.append(measure(pair, method, cfg.sizes.aux_layer_ids, args.k, args.requests, args.max_new_tokens,
                               args.seed, cfg.sizes.vocab_size, log))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python -m coordinator.target.fp8_acceptance " + " ".join(sys.argv[1:] if argv is None
                                                                                  else argv),
            "host": f"{platform.node()} ({platform.machine()}, {torch.get_num_threads()} torch thread)",
            "torch": torch.__version__, "python": platform.python_version()}
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    text = table(results, meta)
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
