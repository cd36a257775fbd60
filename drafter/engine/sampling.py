"""Draft sampling: greedy argmax, or per-request temperature with the exponential race.

With temperature t > 0 a draft is argmax_i p_i / E_i, E_i ~ Exp(1), which is an exact sample
from p = softmax(logits / t) (the Gumbel-max trick in another guise) and needs no sort or
cumulative sum, so it fits inside a CUDA graph.  A greedy row's q is one-hot, which keeps the
target's rejection sampling lossless.
"""

from __future__ import annotations

import torch


def sample_drafts(
    logits: torch.Tensor,  # [batch, vocab]
    temperatures: torch.Tensor | None,  # [batch] float, 0 = greedy; None = all greedy
    generator: torch.Generator | None = None,
    want_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # ids [batch] int64, probs [batch, vocab] | None
    greedy_ids = logits.argmax(dim=-1)
    if temperatures is None:
        probs = None
        if want_probs:
            probs = torch.zeros_like(logits, dtype=torch.float32).scatter_(1, greedy_ids[:, None], 1.0)
        return greedy_ids, probs
    is_greedy = temperatures <= 0
    safe_t = torch.where(is_greedy, torch.ones_like(temperatures), temperatures).float()
    probs = torch.softmax(logits.float() / safe_t[:, None], dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    sampled = (probs / race).argmax(dim=-1)
    ids = torch.where(is_greedy, greedy_ids, sampled)
    if not want_probs:
        return ids, None
    one_hot = torch.zeros_like(probs).scatter_(1, greedy_ids[:, None], 1.0)
    return ids, torch.where(is_greedy[:, None], one_hot, probs)
