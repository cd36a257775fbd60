"""Shared pieces of the fleet tests: the reference output, replaying recorded calls."""

from __future__ import annotations

from dataclasses import replace

import torch

from coordinator.target.engine import TargetConfig, TargetEngine
from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.engine.engine import DraftEngine


def spread_name(endpoints, dp: int, prefix: str = "target") -> str:
    """A fleet name whose DP ranks' sessions land on every endpoint (servers get random ports, so
    rendezvous hashing could otherwise put all ranks on one drafter and skip a transport)."""
    from coordinator.routing import Endpoint, assign, session_key

    eps = [Endpoint.parse(str(e)) for e in endpoints]
    names = (f"{prefix}{i}" for i in range(1000))
    return next(n for n in names
                if len(set(assign([session_key(n, d) for d in range(dp)], eps).values())) == min(dp, len(eps)))


def reference_outputs(target: TargetConfig, requests_by_dp) -> dict[int, list[int]]:
    """The same target decoding the same requests without speculation, in this process."""
    out = {}
    for group in requests_by_dp:
        engine = TargetEngine(replace(target, num_speculative_tokens=0, record_calls=False))
        for r in group:
            engine.add(r)
        out.update(engine.run())
    return out


def replay_calls(pair, target: TargetConfig, calls) -> tuple[int, int]:
    """Feed a rank's recorded drafter calls to a fresh in-process engine (a new one per session
    generation, as the drafter's KV was new): returns (calls compared, calls whose drafts differ)."""
    fresh, generation, compared, differ = None, None, 0, 0
    for call in calls:
        if call.drafts is None:
            continue
        if call.generation != generation:
            generation = call.generation
            fresh = DraftEngine.from_dirs(pair / "head", pair / "target", EngineConfig(
                method=target.method, num_speculative_tokens=target.num_speculative_tokens,
                max_model_len=target.max_model_len, max_num_seqs=target.max_num_seqs,
                max_num_batched_tokens=target.max_num_batched_tokens,
                kv_groups=(KVGroupSpec(target.block_size, target.num_blocks),)))
        out = fresh.propose(**call.kwargs, batch_padded=call.padding.batch_padded,
                            tokens_padded=call.padding.tokens_padded)
        compared += 1
        differ += int(not torch.equal(out.draft_token_ids, call.drafts))
    return compared, differ
