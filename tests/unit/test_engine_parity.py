"""The paged, padded engine against a dense recompute-everything reference."""

from __future__ import annotations

import pytest
import torch

from tests.support.dense import DenseReference
from tests.support.engines import build_engine
from tests.support.scenario import Scenario

MAX_MODEL_LEN = 96


def _scenario(engine, seed=0):
    return Scenario(block_sizes=engine.limits.block_sizes, num_blocks=engine.limits.num_blocks,
                    vocab_size=engine.spec.vocab_size, hidden_width=engine.spec.hidden_input_width,
                    k=engine.config.num_speculative_tokens, max_model_len=MAX_MODEL_LEN, seed=seed,
                    draft_span=engine.limits.draft_span)


def _plans(k: int):
    """Prefills of mixed lengths over several blocks, decode steps with rejections, and a request
    driven up to max_model_len so its drafts cross it."""
    q = k + 1
    yield [(0, 5, 0), (1, 37, 0), (2, 1, 0)]
    yield [(0, q, min(1, q - 1)), (1, q, 0), (2, 20, 0)]
    yield [(1, q, q - 1), (0, q, 0), (2, q, min(2, q - 1)), (3, 70, 0)]
    for _ in range(3):
        yield [(0, q, q // 2), (3, q, 0), (1, q, 1 % q)]
    yield [(3, MAX_MODEL_LEN - 70 - 2 * q - 2, 0)]  # request 3 now ends 2 + some tokens before the limit
    yield [(3, 2, 0), (2, q, 0)]  # request 3's drafts run past max_model_len


def _positions_left(scn, rid):
    return MAX_MODEL_LEN - scn.requests[rid].next_pos


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("head", ["eagle", "eagle3", "mtp", "mtp-multi", "eagle-2groups"])
def test_chain_matches_dense_reference(tiny_root, head, k, padded):
    engine = build_engine(tiny_root, head, k=k, max_model_len=MAX_MODEL_LEN, padded_drafter_batch=padded)
    dense = DenseReference(engine.head, k, MAX_MODEL_LEN)
    scn = _scenario(engine)
    worst = 0.0
    crossed = False
    for plan in _plans(k):
        plan = [(rid, min(q, _positions_left(scn, rid) if rid in scn.requests else q), rej) for rid, q, rej in plan]
        plan = [(rid, q, min(rej, q - 1)) for rid, q, rej in plan if q > 0]
        call = scn.call(plan, padded=padded)
        out = engine.propose(**call.kwargs, return_logits=True)
        dense.last_logits = []
        expected = dense.propose(call, padded=padded)
        assert torch.equal(out.draft_token_ids, expected), f"plan {plan}"
        for r, ref in enumerate(dense.last_logits):
            worst = max(worst, float((out.draft_logits[r] - ref).abs().max()))
        crossed |= any(int(p[-1]) + k > MAX_MODEL_LEN for p, *_ in call.rows)
    assert crossed or k == 1, "the scenario should drive drafts past max_model_len"
    print(f"\n[parity] head={head} k={k} padded={padded}: drafts identical, largest logit difference {worst:.3e}")
    assert worst < 1e-3


@pytest.mark.parametrize("head", ["eagle", "eagle3", "eagle-2groups"])
def test_tree_matches_dense_reference(tiny_root, head):
    tree = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]
    engine = build_engine(tiny_root, head, max_model_len=MAX_MODEL_LEN, speculative_token_tree=tree)
    dense = DenseReference(engine.head, 3, MAX_MODEL_LEN)
    scn = _scenario(engine)
    plans = [[(0, 9, 0), (1, 30, 0)], [(0, 4, 1), (1, 4, 0)], [(1, 4, 3), (0, 4, 2)]]
    for plan in plans:
        call = scn.call(plan)
        out = engine.propose(**call.kwargs)
        assert out.draft_token_ids.shape == (len(plan), len(tree))
        assert torch.equal(out.draft_token_ids, dense.propose_tree(call, engine.config.speculative_token_tree))
