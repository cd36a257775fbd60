"""TP fan-out over gloo: only the source rank asks the drafter; every rank gets the same answer,
including "no drafts" and the session generation; a malformed answer becomes "no drafts"."""

from __future__ import annotations

import torch

from coordinator.session import DraftResult
from coordinator.tp import TPFanout
from tests.support.ranks import run_ranks

K = 3


def _share(rank: int, world: int):
    group = torch.distributed.new_group(list(range(world)))
    fan = TPFanout(K, group=group, src=0, is_src=rank == 0)
    asked = []

    def answer(result):
        def fetch():
            asked.append(rank)
            return result
        return fetch

    drafts = torch.arange(2 * K).view(2, K)
    out = [
        fan.share(2, answer(DraftResult(drafts, 1))),
        fan.share(2, answer(DraftResult(None, 2))),  # fail closed: no drafts, and a new session
        fan.share(2, answer(DraftResult(torch.zeros(5, 1, dtype=torch.long), 2))),  # malformed
        fan.share(1, answer(DraftResult(torch.tensor([[7, 8, 9]], dtype=torch.int32), None))),
    ]
    return asked, [(None if r.drafts is None else r.drafts.tolist(), r.generation) for r in out]


def test_only_the_source_rank_calls_and_every_rank_gets_the_same_result():
    results = run_ranks(_share, 3)
    assert results[0][0] == [0, 0, 0, 0] and results[1][0] == [] and results[2][0] == []
    expected = [([[0, 1, 2], [3, 4, 5]], 1), (None, 2), (None, 2), ([[7, 8, 9]], None)]
    assert all(r[1] == expected for r in results)


def test_a_group_of_one_needs_no_collective():
    fan = TPFanout(K)
    assert fan.share(1, lambda: DraftResult(torch.tensor([[1, 2, 3]]), 4)).generation == 4
    assert fan.share(1, lambda: DraftResult(torch.tensor([[1, 2]]), 4)).drafts is None
