"""Data-parallel padding agreement: every rank of a DP group drafts at one padded size per step.

Before each drafter call the ranks all-reduce (MAX, one gloo collective) their local batch size,
token count and whether they still have work, then round the maxima up to the drafter's capture
sizes (the same tuple on every rank: the fleet's configuration, as vLLM's cudagraph sizes are).
The result is a frozen DPPadding, bit-identical on every rank, like vLLM's
coordinate_batch_across_dp.  The same collective also carries the step counter (as max and
negated min), so ranks that fell out of lock step fail loudly instead of mis-padding.

The dummy step.  A rank with nothing to draft (batch 0: idle, or all its requests finished)
still calls agree() every step, so the others never block on it.  It then sends nothing to the
drafter: its session is its own, the drafter runs no collective across sessions, and a padded
empty request would cost a round trip and drafter time for no output.  The reference target's
forward has no cross-DP collective either, so the idle rank's dummy step is exactly its share of
the agreement; a target whose forward does join collectives (MoE all-to-all) would run its dummy
forward at `tokens_padded` here.  When no rank has work left, `any_work` is False everywhere in
the same step and the whole group stops together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from drafter.engine.config import pad_to_capture_size


class DPDesync(RuntimeError):
    pass


def capture_sizes_up_to(maximum: int) -> tuple[int, ...]:
    """Powers of two below `maximum`, then `maximum`: the drafter's default capture sizes."""
    sizes, s = [], 1
    while s < maximum:
        sizes.append(s)
        s *= 2
    return tuple(sizes) + (maximum,)


@dataclass(frozen=True)
class DPPadding:
    step: int
    max_batch: int  # largest real batch over the group's ranks
    max_tokens: int
    batch_padded: int  # max_batch rounded up to a capture size; 0 when no rank drafts
    tokens_padded: int
    any_work: bool  # some rank still has requests (running or waiting)


class DPAgreement:
    def __init__(self, capture_sizes: tuple[int, ...], token_capture_sizes: tuple[int, ...], group=None):
        if not capture_sizes or not token_capture_sizes:
            raise ValueError("capture sizes must not be empty")
        self.capture_sizes = tuple(sorted(capture_sizes))
        self.token_capture_sizes = tuple(sorted(token_capture_sizes))
        self.group = group  # None: a group of one (no collective)
        self.step = 0

    def agree(self, batch: int, num_tokens: int, has_work: bool) -> DPPadding:
        if batch < 0 or num_tokens < 0 or (batch == 0) != (num_tokens == 0):
            raise ValueError(f"bad local sizes batch={batch} tokens={num_tokens}")
        local = torch.tensor([batch, num_tokens, int(has_work), self.step, -self.step], dtype=torch.int64)
        if self.group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
        max_batch, max_tokens, work, top, neg_low = local.tolist()
        if top != -neg_low:
            raise DPDesync(f"DP ranks are at different steps ({-neg_low}..{top})")
        self.step += 1
        if max_batch == 0:
            return DPPadding(top, 0, 0, 0, 0, bool(work))
        return DPPadding(top, max_batch, max_tokens, pad_to_capture_size(max_batch, self.capture_sizes),
                         pad_to_capture_size(max_tokens, self.token_capture_sizes), bool(work))
