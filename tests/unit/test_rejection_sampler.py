"""Verification keeps the target's distribution: empirical checks with fixed seeds (cannot flake)."""

from __future__ import annotations

import pytest
import torch

from coordinator.target.verify import Verdict, ks_uniform, randomized_pit, rejection_sample, verify_greedy
from tests.support.pair import one_torch_thread  # noqa: F401 (fixture)

V = 6  # a small vocabulary: every cell of the joint distribution gets plenty of samples
N = 20_000


def _dists(seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, dim=-1)  # target: after prefix, after d1, after d2
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, dim=-1)  # drafter
    return p, q


def _joint_counts(sampler, p, draw_drafts, n, seed):
    """Counts of (first emitted token, second emitted token or V meaning 'step ended')."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V + 1)
    for _ in range(n):
        v = sampler(p, draw_drafts(g), g)
        second = v.tokens[1] if v.num_emitted > 1 else V
        counts[v.tokens[0], second] += 1
    return counts


def _expected_joint(p, q0):
    """What sampling the target alone gives: y1 ~ p0, and the step goes on (d1 accepted) with
    probability min(q0(y1), p0(y1)), in which case y2 ~ p1.  q0 is the first draft's distribution
    (one-hot for greedy drafts)."""
    go_on = torch.minimum(q0, p[0])
    exp = torch.zeros(V, V + 1)
    exp[:, V] = p[0] - go_on
    exp[:, :V] = go_on[:, None] * p[1][None, :]
    return exp


def _chi_square_p(counts, expected):
    keep = expected.flatten() > 0
    obs = counts.flatten()[keep]
    exp = expected.flatten()[keep] * counts.sum()
    assert obs.sum() == counts.sum(), "a token the target cannot emit was emitted"
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(chi2 / 2, dtype=torch.float64)))  # chi-square sf


@pytest.mark.parametrize("draft_kind", ["greedy", "sampled"])
def test_rejection_sampling_keeps_the_target_distribution(draft_kind):
    p, q = _dists(0)
    if draft_kind == "greedy":
        fixed = [int(q[0].argmax()), int(q[1].argmax())]
        draw = lambda g: fixed  # noqa: E731
        sampler = lambda p_, d, g: rejection_sample(p_, d, g)  # one-hot q  # noqa: E731
        q0 = torch.nn.functional.one_hot(torch.tensor(fixed[0]), V).float()
    else:
        draw = lambda g: [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]  # noqa: E731
        sampler = lambda p_, d, g: rejection_sample(p_, d, g, draft_probs=q)  # noqa: E731
        q0 = q[0]
    counts = _joint_counts(sampler, p, draw, N, seed=123)
    expected = _expected_joint(p, q0)
    tv = 0.5 * float((counts / N - expected).abs().sum())
    pvalue = _chi_square_p(counts, expected)
    print(f"\n[rejection sampler, {draft_kind} drafts] TV distance {tv:.4f}, chi-square p = {pvalue:.3f}")
    assert tv < 0.02 and pvalue > 1e-3


def test_distribution_check_catches_a_biased_sampler():
    """The same check fails a sampler that keeps every draft (what a verification bug looks like)."""
    p, q = _dists(0)
    fixed = [int(q[0].argmax()), int(q[1].argmax())]
    def keep_all(p_, d, g):
        return Verdict(len(d), tuple(d) + (int(torch.multinomial(p_[len(d)], 1, generator=g)),))

    counts = _joint_counts(keep_all, p, lambda g: fixed, 4000, seed=5)
    expected = _expected_joint(p, torch.nn.functional.one_hot(torch.tensor(fixed[0]), V).float())
    assert 0.5 * float((counts / 4000 - expected).abs().sum()) > 0.3


def test_greedy_verification():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])  # argmax 1, 0, 2
    assert verify_greedy(logits, [1, 0]) == Verdict(2, (1, 0, 2))  # all accepted + bonus
    assert verify_greedy(logits, [1, 2]) == Verdict(1, (1, 0))  # second rejected, corrected to 0
    assert verify_greedy(logits, [2, 0]) == Verdict(0, (1,))
    assert verify_greedy(logits[:1], []) == Verdict(0, (1,))


def test_certain_drafts_are_always_accepted_and_stream_use_is_fixed():
    """p(d) = 1 accepts; the generator advances the same whatever the verdict (TP ranks stay in step)."""
    p = torch.zeros(3, V)
    p[0, 2] = p[1, 4] = p[2, 0] = 1.0
    g = torch.Generator().manual_seed(0)
    assert rejection_sample(p, [2, 4], g) == Verdict(2, (2, 4, 0))


def test_randomized_pit_is_uniform_for_target_samples():
    p, _ = _dists(3)
    g = torch.Generator().manual_seed(9)
    u = [randomized_pit(p[0], int(torch.multinomial(p[0], 1, generator=g)), float(torch.rand((), generator=g)))
         for _ in range(3000)]
    assert ks_uniform(u)[1] > 1e-3
    biased = [randomized_pit(p[0], int(p[0].argmax()), float(torch.rand((), generator=g))) for _ in range(300)]
    assert ks_uniform(biased)[1] < 1e-6
