"""Padding never changes drafts, and padded rows never touch the KV pool."""

from __future__ import annotations

import pytest
import torch

from tests.support.engines import build_engine
from tests.support.scenario import Scenario

MAX_MODEL_LEN = 80


def _allowed_slots(engine, call) -> list[set[int]]:
    """Per KV group, every slot this call may legitimately write: all query rows plus the
    draft positions after each request's sampled token (until max_model_len)."""
    allowed = [set() for _ in engine.limits.block_sizes]
    k = engine.config.num_speculative_tokens
    for r, (pos, _, _, sample_off) in enumerate(call.rows):
        positions = pos.tolist() + [int(pos[sample_off]) + i for i in range(1, k)]
        for g, bs in enumerate(engine.limits.block_sizes):
            table = call.kwargs["block_tables"][g][r]
            for p in positions:
                if p < MAX_MODEL_LEN:
                    allowed[g].add(int(table[p // bs]) * bs + p % bs)
    return allowed


def _unchanged_outside(engine, before, after, allowed):
    for layer, (b, a) in enumerate(zip(before, after)):
        g = engine.kv.kv_group_of_layer[layer]
        changed = (b != a).flatten(3).any(-1).any(0).flatten()  # per slot
        outside = [s for s in changed.nonzero().flatten().tolist() if s not in allowed[g]]
        assert not outside, f"layer {layer}: slots {outside[:8]} outside the request's own slots changed"


@pytest.mark.parametrize("head", ["eagle3", "mtp-multi"])
def test_padding_to_any_capture_size_gives_identical_drafts(tiny_root, head):
    sizes = dict(capture_sizes=(2, 4, 8), token_capture_sizes=(16, 32, 64, 128))
    engines = [build_engine(tiny_root, head, k=3, max_model_len=MAX_MODEL_LEN, **sizes) for _ in range(4)]
    scenarios = [Scenario(block_sizes=e.limits.block_sizes, num_blocks=e.limits.num_blocks,
                          vocab_size=e.spec.vocab_size, hidden_width=e.spec.hidden_input_width, k=3,
                          max_model_len=MAX_MODEL_LEN, seed=7) for e in engines]
    plans = [[(0, 9, 0), (1, 3, 0)], [(0, 4, 1), (1, 4, 3)], [(1, 4, 0), (0, 4, 2)]]
    paddings = [(None, None), (4, 64), (8, 128), (2, 16)]  # (batch_padded, tokens_padded); None = capture size
    for plan in plans:
        results = []
        for engine, scn, (b_pad, t_pad) in zip(engines, scenarios, paddings):
            call = scn.call(plan)
            before = engine.kv_snapshot()
            out = engine.propose(**call.kwargs, batch_padded=b_pad, tokens_padded=t_pad)
            _unchanged_outside(engine, before, engine.kv_snapshot(), _allowed_slots(engine, call))
            results.append((out.draft_token_ids, out.batch_padded, out.tokens_padded))
        for ids, b_pad, t_pad in results[1:]:
            assert torch.equal(ids, results[0][0]), f"padding to ({b_pad}, {t_pad}) changed the drafts"
        assert {r[1] for r in results} == {2, 4, 8}


def test_agreed_padded_size_must_cover_the_batch(tiny_root):
    engine = build_engine(tiny_root, "eagle", k=2, max_model_len=MAX_MODEL_LEN, capture_sizes=(2, 4, 8))
    scn = Scenario(block_sizes=engine.limits.block_sizes, num_blocks=engine.limits.num_blocks,
                   vocab_size=engine.spec.vocab_size, hidden_width=engine.spec.hidden_input_width, k=2,
                   max_model_len=MAX_MODEL_LEN)
    call = scn.call([(0, 3, 0), (1, 3, 0), (2, 3, 0)])
    with pytest.raises(ValueError, match="batch_padded"):
        engine.propose(**call.kwargs, batch_padded=2)
