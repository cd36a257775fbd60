"""Verification of drafts by the target: greedy, and lossless rejection sampling.

For one request the target ran j + 1 query rows [last token, d_1 .. d_j]; row i's distribution
p_i is the target's for the token after d_i (row 0: after the last token).  Rejection sampling
(Leviathan et al., Chen et al.) accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)); on the
first rejection it emits a sample of norm(max(p_i - q_i, 0)) and stops; if every draft is
accepted it emits a bonus sample of p_j.  Every emitted token is then distributed exactly as
the target alone would sample it, whatever the drafts were.  A greedy draft is a one-hot q
(the drafter returns no probabilities for it), which keeps the rule exact.  Greedy targets
(temperature 0) accept while the draft equals the argmax.

verify_coupled is the same rule for one-hot drafts with the randomness tied to positions instead
of a stream: the target's token at position t is argmax_v p_t(v) / E_t(v), E_t(v) ~ Exp(1) drawn
from a generator seeded by (request seed, t) (the exponential race: an exact sample of p_t); a
draft is accepted iff it equals that token, and the first differing position emits it.  Accepting
d with probability p(d) and, on rejection, emitting a sample of p with d removed is exactly
rejection sampling's rule for a one-hot q, so the output is distributed as the target's; and since
each emitted token is a function of (seed, position, prefix) alone, sampled output is the same
token for token whatever the drafts were (none, exact, or pre-drafted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # drafts accepted, 0..j
    tokens: tuple[int, ...]  # emitted tokens: the accepted drafts, then one corrected or bonus token

    @property
    def num_emitted(self) -> int:
        return len(self.tokens)


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:  # [rows, V] -> [rows, V] float32
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:  # probs: [V]
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_greedy(
    logits: torch.Tensor,  # [j + 1, V]
    drafts: list[int],  # j
) -> Verdict:
    best = logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == best[accepted]:
        accepted += 1
    return Verdict(accepted, tuple(drafts[:accepted]) + (best[accepted],))


def rejection_sample(
    probs: torch.Tensor,  # [j + 1, V] the target's p_i (temperature applied)
    drafts: list[int],  # j
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,  # [j, V] q_i; None = greedy drafts (one-hot q)
) -> Verdict:
    for i, d in enumerate(drafts):
        p = probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        # draw u even when acceptance is certain: the generator's stream then depends only on how
        # many drafts were verified, the same on every TP rank
        u = float(torch.rand((), generator=generator))
        if q_d > 0 and u < min(1.0, float(p[d]) / q_d):
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = torch.clamp(p - draft_probs[i].to(p.dtype), min=0.0)
        total = float(residual.sum())
        # total == 0 only if p <= q everywhere, i.e. p == q: then acceptance was certain.  Guard
        # anyway against float dust by falling back to p.
        token = sample(residual / total if total > 0 else p, generator)
        return Verdict(i, tuple(drafts[:i]) + (token,))
    return Verdict(len(drafts), tuple(drafts) + (sample(probs[len(drafts)], generator),))


def position_sample(probs: torch.Tensor, seed: int, position: int) -> int:  # probs: [V]
    """The target's sample at `position`: argmax p / E with E ~ Exp(1) keyed by (seed, position)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + position) % (2 ** 63))
    race = torch.empty(probs.shape[-1], dtype=torch.float64).exponential_(generator=g)
    return int(torch.argmax(probs.double() / race))


def verify_coupled(
    probs: torch.Tensor,  # [j + 1, V] the target's p_i (temperature applied)
    drafts: list[int],  # j greedy (one-hot) drafts
    seed: int,
    first_position: int,  # the position of the token row 0 samples
) -> Verdict:
    tokens = []
    for i in range(len(drafts) + 1):
        token = position_sample(probs[i], seed, first_position + i)
        tokens.append(token)
        if i == len(drafts) or token != drafts[i]:
            return Verdict(i, tuple(tokens))
    raise AssertionError("unreachable")


def randomized_pit(probs: torch.Tensor, token: int, u: float) -> float:
    """Randomised probability integral transform of a categorical sample (probs: [V]).

    F(token - 1) + u * p(token) is Uniform(0, 1) exactly when token ~ probs and u ~ U(0, 1),
    so a stream of these from the whole run tests the sampler's distribution with one KS test."""
    below = float(probs[:token].sum()) if token > 0 else 0.0
    return below + u * float(probs[token])


def ks_uniform(values) -> tuple[float, float]:
    """Kolmogorov-Smirnov test of values against U(0, 1): (statistic D, asymptotic p-value).

    With randomized_pit this checks a sampler against the target's distribution without scipy."""
    u = torch.sort(torch.as_tensor(list(values), dtype=torch.float64)).values
    n = u.numel()
    if n == 0:
        raise ValueError("no values")
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = float(torch.maximum(i / n - u, u - (i - 1) / n).max())
    # Kolmogorov's limit distribution, with Stephens' small-sample correction of the statistic
    t = (n ** 0.5 + 0.12 + 0.11 / n ** 0.5) * d
    k = torch.arange(1, 101, dtype=torch.float64)
    p = float(2 * ((-1) ** (k - 1) * torch.exp(-2 * k ** 2 * t ** 2)).sum())
    return d, min(1.0, max(0.0, p))
