"""drafter.engine.step_guard on CPU tensors: every field corrupted in turn is named by the error
word, masked to the session's own range, and a clean step passes through shifted into the pool."""

from __future__ import annotations

import pytest
import torch

from drafter.engine.step_guard import GuardLimits, StepGuard
from drafter.wire import bound as wb

T, B, COLS, WIDTH = 16, 4, 6, 8
LIMITS = GuardLimits(vocab_size=100, max_model_len=40, num_speculative_tokens=3, num_blocks=(8, 5),
                     block_sizes=(4, 8), bases=(8, 20))


def _clean() -> dict[str, torch.Tensor]:
    """A valid step of 3 requests (4 + 3 + 2 tokens) in buffers of capacity T tokens, B requests."""
    g = torch.Generator().manual_seed(1)
    src = {"target_token_ids": torch.randint(0, 100, (T,), generator=g),
           "target_positions": torch.randint(0, 40, (T,), generator=g),
           wb.HIDDEN: torch.randn(T, WIDTH, generator=g),
           "next_token_ids": torch.randint(0, 100, (B,), generator=g),
           "query_start_loc": torch.tensor([0, 4, 7, 9, 9], dtype=torch.int32),
           "seq_lens": torch.tensor([10, 20, 30, 0], dtype=torch.int32),
           "token_indices_to_sample": torch.tensor([3, 6, 8, 0], dtype=torch.int32),
           "num_rejected_tokens": torch.tensor([0, 1, 3, 0], dtype=torch.int32)}
    for grp, (blocks, size) in enumerate(zip(LIMITS.num_blocks, LIMITS.block_sizes)):
        src[f"block_tables[{grp}]"] = torch.randint(0, blocks, (B, COLS), generator=g, dtype=torch.int32)
        slots = torch.randint(0, blocks * size, (T,), generator=g)
        slots[2] = -1
        src[f"slot_mappings[{grp}]"] = slots
    return src


def _guard(src):
    error = torch.full((1,), -7, dtype=torch.int64)
    return StepGuard(src, LIMITS, error), error


def _within_session(guard, n, b) -> None:
    """Every block id and slot the engine will read lies in the session's own range (or is -1)."""
    for g, (base, blocks, size) in enumerate(zip(LIMITS.bases, LIMITS.num_blocks, LIMITS.block_sizes)):
        table = guard.out[f"block_tables[{g}]"]
        assert ((table >= base) & (table < base + blocks)).all()
        slots = guard.out[f"slot_mappings[{g}]"]
        assert ((slots == -1) | ((slots >= base * size) & (slots < (base + blocks) * size))).all()


def test_a_clean_step_passes_shifted_into_the_pool():
    src = _clean()
    guard, error = _guard(src)
    guard.step(9, 3)
    assert error.item() == 0
    assert torch.equal(guard.out["target_token_ids"][:9], src["target_token_ids"][:9])
    assert (guard.out["target_token_ids"][9:] == 0).all()
    assert torch.equal(guard.out["query_start_loc"][:4], src["query_start_loc"][:4])
    for g, (base, size) in enumerate(zip(LIMITS.bases, LIMITS.block_sizes)):
        assert torch.equal(guard.out[f"block_tables[{g}]"][:3], src[f"block_tables[{g}]"][:3] + base)
        slots, want = guard.out[f"slot_mappings[{g}]"], src[f"slot_mappings[{g}]"]
        assert torch.equal(slots[:9], torch.where(want[:9] >= 0, want[:9] + base * size, -1))
        assert (slots[9:] == -1).all()
    _within_session(guard, 9, 3)


CORRUPTIONS = [
    ("target_token_ids", lambda s: s["target_token_ids"].__setitem__(5, 100)),
    ("target_token_ids", lambda s: s["target_token_ids"].__setitem__(0, -1)),
    ("target_positions", lambda s: s["target_positions"].__setitem__(8, 40)),
    (wb.HIDDEN, lambda s: s[wb.HIDDEN].__setitem__((4, 3), float("nan"))),
    (wb.HIDDEN, lambda s: s[wb.HIDDEN].__setitem__((8, 0), float("inf"))),
    ("next_token_ids", lambda s: s["next_token_ids"].__setitem__(2, 1 << 40)),
    ("query_start_loc", lambda s: s["query_start_loc"].__setitem__(0, 1)),
    ("query_start_loc", lambda s: s["query_start_loc"].__setitem__(3, 10)),
    ("query_start_loc", lambda s: s["query_start_loc"].__setitem__(2, 4)),
    ("seq_lens", lambda s: s["seq_lens"].__setitem__(1, 41)),
    ("seq_lens", lambda s: s["seq_lens"].__setitem__(0, 0)),
    ("block_tables[0]", lambda s: s["block_tables[0]"].__setitem__((1, 2), 8)),
    ("block_tables[1]", lambda s: s["block_tables[1]"].__setitem__((2, 5), -3)),
    ("slot_mappings[0]", lambda s: s["slot_mappings[0]"].__setitem__(3, 32)),
    ("slot_mappings[1]", lambda s: s["slot_mappings[1]"].__setitem__(7, -2)),
    ("token_indices_to_sample", lambda s: s["token_indices_to_sample"].__setitem__(1, 9)),
    ("num_rejected_tokens", lambda s: s["num_rejected_tokens"].__setitem__(0, 4)),
]


@pytest.mark.parametrize("field,corrupt", CORRUPTIONS)
def test_each_corrupt_field_is_named_and_masked(field, corrupt):
    src = _clean()
    corrupt(src)
    guard, error = _guard(src)
    guard.step(9, 3)
    word = error.item()
    assert wb.first_bad_guard_field(word, 2) == field
    assert word == 1 << wb.guard_fields(2).index(field)  # only that field
    _within_session(guard, 9, 3)
    out = guard.out
    assert ((out["target_token_ids"] >= 0) & (out["target_token_ids"] < 100)).all()
    assert ((out["target_positions"] >= 0) & (out["target_positions"] < 40)).all()
    assert ((out["seq_lens"][:3] >= 1) & (out["seq_lens"][:3] <= 40)).all()
    q = out["query_start_loc"][:4]
    assert q[0] == 0 and q[3] == 9 and (q[1:] > q[:-1]).all()
    if field == wb.HIDDEN:  # the non-finite token writes no KV in any group
        row = 4 if torch.isnan(src[wb.HIDDEN][4]).any() else 8
        assert all(out[f"slot_mappings[{g}]"][row] == -1 for g in range(2))


def test_rows_past_the_step_are_neither_checked_nor_passed_on():
    src = _clean()
    src["target_token_ids"][12] = -5  # past num_tokens 9
    src["block_tables[0]"][3] = 99  # past batch 3
    guard, error = _guard(src)
    guard.step(9, 3)
    assert error.item() == 0
    assert guard.out["target_token_ids"][12] == 0
    assert (guard.out["block_tables[0]"][3] == LIMITS.bases[0]).all()


def test_the_word_is_rewritten_every_step():
    src = _clean()
    guard, error = _guard(src)
    src["seq_lens"][0] = 99
    guard.step(9, 3)
    assert wb.first_bad_guard_field(error.item(), 2) == "seq_lens"
    src["seq_lens"][0] = 10
    guard.step(9, 3)
    assert error.item() == 0


def test_two_bad_fields_name_the_first_in_order():
    src = _clean()
    src["slot_mappings[1]"][0] = 1000
    src["target_positions"][0] = -1
    guard, error = _guard(src)
    guard.step(9, 3)
    assert wb.first_bad_guard_field(error.item(), 2) == "target_positions"
    assert bin(error.item()).count("1") == 2
