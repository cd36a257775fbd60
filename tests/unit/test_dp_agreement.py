"""DP padding agreement over gloo: ranks with different batch sizes (one idle) agree on one frozen
value every step, and every rank takes part in every step until the whole group is done."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from coordinator.dp_agreement import DPAgreement, DPDesync, DPPadding, capture_sizes_up_to
from tests.support.ranks import run_ranks

CAPTURE = (1, 2, 4, 8)
TOKEN_CAPTURE = (8, 16, 32, 64, 128)


def _agree_loop(rank: int, world: int, work: list[list[tuple[int, int]]]):
    """Rank r drafts work[r][step] = (batch, tokens) per step; an exhausted list means idle."""
    group = torch.distributed.new_group(list(range(world)))
    agreement = DPAgreement(CAPTURE, TOKEN_CAPTURE, group=group)
    mine = work[rank]
    log = []
    step = 0
    while True:
        batch, tokens = mine[step] if step < len(mine) else (0, 0)
        has_work = step + 1 < len(mine)
        padding = agreement.agree(batch, tokens, has_work)
        # "run" the step: a busy rank drafts at the agreed size, an idle one runs a dummy step
        kind = "draft" if batch else "dummy"
        log.append((padding, batch, kind))
        step += 1
        if not padding.any_work:
            return log


def test_ranks_with_different_batches_agree_on_one_padded_size():
    work = [
        [(3, 20), (3, 12), (2, 8), (1, 4)],  # rank 0: shrinking batch
        [],  # rank 1: idle from the start
        [(5, 70), (1, 4)],  # rank 2: finishes early, then idles
    ]
    logs = run_ranks(_agree_loop, 3, work)
    steps = [len(log) for log in logs]
    assert steps[0] == steps[1] == steps[2] == 4  # everyone ran every step, nobody blocked
    for s in range(4):
        values = {log[s][0] for log in logs}
        assert len(values) == 1, f"step {s}: ranks disagree: {values}"  # one frozen, identical value
    got = [logs[0][s][0] for s in range(4)]
    assert got == [DPPadding(0, 5, 70, 8, 128, True), DPPadding(1, 3, 12, 4, 16, True),
                   DPPadding(2, 2, 8, 2, 8, True), DPPadding(3, 1, 4, 1, 8, False)]
    assert [k for _, _, k in logs[1]] == ["dummy"] * 4
    assert [k for _, _, k in logs[2]] == ["draft", "draft", "dummy", "dummy"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        got[0].batch_padded = 1
    print("\n[dp agreement] per step (max batch, padded batch, padded tokens):",
          [(p.max_batch, p.batch_padded, p.tokens_padded) for p in got])


def _desync(rank: int, world: int):
    agreement = DPAgreement(CAPTURE, TOKEN_CAPTURE, group=torch.distributed.new_group(list(range(world))))
    if rank == 1:
        agreement.step = 5  # a rank that skipped steps
    try:
        agreement.agree(1, 1, True)
    except DPDesync as e:
        return str(e)
    return None


def test_ranks_out_of_lock_step_fail_loudly():
    assert all(r is not None and "different steps" in r for r in run_ranks(_desync, 2))


def test_single_rank_and_local_rules():
    a = DPAgreement(CAPTURE, TOKEN_CAPTURE)
    assert a.agree(3, 9, True) == DPPadding(0, 3, 9, 4, 16, True)
    assert a.agree(0, 0, False) == DPPadding(1, 0, 0, 0, 0, False)
    with pytest.raises(ValueError):
        a.agree(1, 0, True)
    assert capture_sizes_up_to(6) == (1, 2, 4, 6) and capture_sizes_up_to(1) == (1,)
