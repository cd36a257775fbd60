"""Draft sampling: greedy is argmax with a one-hot q; temperature sampling follows softmax(l / t)."""

from __future__ import annotations

import torch

from drafter.engine.sampling import sample_drafts
from tests.support.engines import build_engine
from tests.support.scenario import Scenario


def test_greedy_rows_are_argmax_with_one_hot_probs():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    ids, probs = sample_drafts(logits, torch.zeros(5), want_probs=True)
    assert torch.equal(ids, logits.argmax(-1))
    assert torch.equal(probs, torch.nn.functional.one_hot(ids, 11).float())


def test_exponential_race_matches_the_softmax_distribution():
    g = torch.Generator().manual_seed(1234)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    temps = torch.tensor([0.7])
    n = 20000
    ids, probs = sample_drafts(logits.expand(n, -1), temps.expand(n), generator=g, want_probs=True)
    empirical = torch.bincount(ids, minlength=5).float() / n
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert torch.allclose(probs[0], expected)
    total_variation = 0.5 * (empirical - expected).abs().sum()
    assert total_variation < 0.02, f"TV {total_variation:.4f}"


def test_engine_temperature_path_returns_probs_in_target_vocab(tiny_root):
    engine = build_engine(tiny_root, "eagle3", k=3)
    scn = Scenario(block_sizes=engine.limits.block_sizes, num_blocks=engine.limits.num_blocks,
                   vocab_size=engine.spec.vocab_size, hidden_width=engine.spec.hidden_input_width, k=3,
                   max_model_len=96)
    call = scn.call([(0, 6, 0), (1, 5, 0)], temperatures=[0.0, 1.0])
    out = engine.propose(**call.kwargs, return_probs=True)
    assert out.draft_probs.shape == (2, 3, engine.spec.vocab_size)
    assert torch.allclose(out.draft_probs.sum(-1), torch.ones(2, 3))
    # every draft has positive probability under its own q, and the greedy row's q is one-hot on it
    picked = out.draft_probs.gather(2, out.draft_token_ids[..., None]).squeeze(-1)
    assert bool((picked > 0).all())
    assert torch.equal(picked[0], torch.ones(3))
    # draft ids live in the target vocabulary, restricted to the head's draft vocabulary
    allowed = torch.arange(engine.spec.draft_vocab_size) + engine.head.d2t
    assert bool(torch.isin(out.draft_token_ids, allowed).all())
