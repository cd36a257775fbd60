"""Replay a target's recorded draft calls on a fresh engine with pre-drafting: every row whose
outcome the offline pre-drafts cover must have verified exactly that pre-draft, every other row
the exact drafts (the check behind 'on a hit the drafts used equal what the engine pre-drafts
offline for that outcome')."""

from __future__ import annotations

import torch

from coordinator.predraft import call_inputs
from drafter.wire.predraft import lookup, outcomes_of_call


def replay_against_offline(calls, fresh) -> tuple[int, int]:
    """calls: TargetEngine.calls (record_calls=True); fresh: a DraftEngine with predraft_outcomes as
    the drafter had.  Returns (hits, misses) over rows that verified drafts."""
    offline, hits, misses = None, 0, 0
    for call in calls:
        if call.drafts is None:
            continue
        exact = fresh.propose(**call.kwargs, batch_padded=call.padding.batch_padded,
                              tokens_padded=call.padding.tokens_padded).draft_token_ids
        inp = call_inputs(call.kwargs)
        for r, outcome in enumerate(outcomes_of_call(inp, call.accepted_counts)):
            want = lookup(offline, outcome)
            k = exact.shape[1]
            if want is None:  # past k, -1: a row padded to a deeper pre-draft's width verifies k
                assert torch.equal(call.drafts[r, :k], exact[r]) and bool((call.drafts[r, k:] == -1).all()), \
                    f"step {call.step} row {r}: not the exact drafts"
                misses += outcome is not None
            else:
                assert call.drafts[r].tolist() == want.tolist(), f"step {call.step} row {r}: not the pre-draft"
                hits += 1
        offline = fresh.predraft(inp, call.drafts, call.step)
    return hits, misses
