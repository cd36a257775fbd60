"""Measure pre-drafting on the reference target loop (CPU): hit rate by accepted length a, and
acceptance with and without pre-drafting, for a few outcome budgets.

    python -m coordinator.target.predraft_report PAIR_DIR [--outcomes 1 4 8] [--temperature 0 1]

PAIR_DIR holds a pair trained by coordinator.target.distill (target/ and head/); it is trained
there first if it does not exist.  Output is identical to plain decoding for greedy requests
(checked here), and distributed as the target's for sampled ones (tests/unit/test_predraft.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from coordinator.inprocess import InProcessTransport
from coordinator.remote_proposer import ProposerConfig, RemoteProposer
from coordinator.routing import Router, StaticEndpoints
from coordinator.target.engine import TargetConfig, TargetEngine
from coordinator.target.request import RequestSpec, random_requests


@dataclass(frozen=True)
class LoopConfig:
    pair: str
    k: int = 3
    outcomes: int = 0  # pre-drafts per request; 0 = off
    predraft_tokens: int = 0  # k': drafts per pre-draft (0 = k); deeper, a hit's row verifies k'
    max_model_len: int = 128
    max_num_seqs: int = 4
    num_blocks: int = 64


def run_loop(cfg: LoopConfig, requests: list[RequestSpec]) -> tuple[TargetEngine, dict[int, list[int]]]:
    """The reference target over the in-process drafter (k = 0: plain decoding)."""
    from coordinator.predraft import InProcessPreDrafting, PreDraftingTransport

    pair = Path(cfg.pair)
    engine = TargetEngine(TargetConfig(str(pair / "target"), method="eagle3", aux_layer_ids=(1, 2, 3),
                                       num_speculative_tokens=cfg.k, max_model_len=cfg.max_model_len,
                                       max_num_seqs=cfg.max_num_seqs, num_blocks=cfg.num_blocks, record_calls=True,
                                       predraft_tokens=cfg.predraft_tokens if cfg.outcomes else 0))
    if cfg.k:
        args = (pair / "head", pair / "target", "eagle3")
        transport = (PreDraftingTransport(*args, outcomes=cfg.outcomes, predraft_tokens=cfg.predraft_tokens)
                     if cfg.outcomes
                     else InProcessTransport(*args))
        proposer = RemoteProposer(engine.session_spec("report"),
                                  router=Router(StaticEndpoints(["inprocess://local:0"])), key="report/dp0",
                                  connect=lambda ep: transport, config=ProposerConfig(deadline_s=60))
        proposer.start()
        engine.proposer = proposer
        if cfg.outcomes:
            engine.predraft = InProcessPreDrafting(transport, proposer)
    for r in requests:
        engine.add(r)
    return engine, engine.run()


def hit_step_acceptance(engine: TargetEngine, out: dict[int, list[int]]) -> tuple[float, float]:
    """Greedy only: tokens per step on the steps a pre-draft was used, for the exact drafts the
    drafter also computed and for the pre-drafts (each read against the final output)."""
    totals = [0, 0]
    for rid, first, exact, pre in engine.stats.hits:
        truth = out[rid][first:]
        for i, drafts in enumerate((exact, pre)):
            n = 0
            while n < len(drafts) and n < len(truth) - 1 and drafts[n] == truth[n]:
                n += 1
            totals[i] += n
    hits = max(1, len(engine.stats.hits))
    return 1 + totals[0] / hits, 1 + totals[1] / hits


def report(pair: str, outcomes: list[int], temperatures: list[float], num_requests: int = 8,
           max_new_tokens: int = 48) -> list[str]:
    lines = []
    for temp in temperatures:
        reqs = random_requests(num_requests, vocab_size=512, max_new_tokens=max_new_tokens, seed=11,
                               temperature=temp)
        _, base = run_loop(LoopConfig(pair, k=0), reqs)
        plain, _ = run_loop(LoopConfig(pair), reqs)
        ps = plain.stats
        lines.append(f"temperature {temp}: without pre-drafting acceptance length {ps.acceptance_length:.2f}, "
                     f"per position {[round(x, 2) for x in ps.acceptance_by_position]}")
        for b in outcomes:
            engine, out = run_loop(LoopConfig(pair, outcomes=b), reqs)
            if temp == 0 and out != base:
                raise AssertionError(f"outcomes {b}: greedy output differs from plain decoding")
            st, s = engine.predraft.picker.stats, engine.stats
            by_a = ", ".join(f"a={a}: {st.hits.get(a, 0)}/{n}" for a, n in sorted(st.rows.items()))
            pre_acc = [round(a / n, 2) if n else 0.0 for a, n in zip(s.accepted_pre, s.proposed_pre)]
            line = (f"  outcomes {b}: hit rate {st.hit_rate:.2f} ({by_a}); acceptance length "
                    f"{s.acceptance_length:.2f}, per position {[round(x, 2) for x in s.acceptance_by_position]}, "
                    f"pre-drafted tokens {pre_acc}")
            if temp == 0:
                exact, used = hit_step_acceptance(engine, out)
                line += f"; on hit steps {used:.2f} tokens with pre-drafts vs {exact:.2f} with exact drafts"
            lines.append(line)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="pre-drafting on the reference target loop (CPU)")
    p.add_argument("pair")
    p.add_argument("--outcomes", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--requests", type=int, default=8)
    args = p.parse_args(argv)
    from coordinator.target.distill import DistillConfig, train_pair

    torch.set_num_threads(1)
    print(train_pair(args.pair, DistillConfig(method="eagle3")).to_json())
    for line in report(args.pair, args.outcomes, args.temperature, args.requests):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
