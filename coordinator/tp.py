"""Tensor-parallel fan-out: one TP rank talks to the drafter, every TP rank gets the same drafts.

Hidden states are replicated across TP ranks (after the all-reduce that ends every TP layer),
so the group's source rank (TP rank 0) alone sends them.  It then broadcasts the outcome in the
target's own TP group: one int64 tensor [ok, generation, drafts...], so the "no drafts" verdict
and a session change (which resets every rank's drafter frontiers) reach all ranks in the same
collective as the drafts.  Ranks > 0 never open a connection to a drafter.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from coordinator.session import DraftResult

_NONE_GENERATION = -1


class TPFanout:
    def __init__(self, k: int, group=None, src: int = 0, is_src: bool = True):
        self.k = k
        self.group = group  # None: a group of one (no collective)
        self.src = src  # global rank of the group's TP rank 0
        self.is_src = is_src

    def share(self, batch: int, fetch: Callable[[], DraftResult]) -> DraftResult:
        """fetch() runs on the source rank only; every rank returns the same result."""
        if self.group is None:
            return _checked(fetch(), batch, self.k)
        buf = torch.zeros(2 + batch * self.k, dtype=torch.int64)
        result = None
        if self.is_src:
            result = _checked(fetch(), batch, self.k)
            buf[0] = int(result.drafts is not None)
            buf[1] = _NONE_GENERATION if result.generation is None else result.generation
            if result.drafts is not None:
                buf[2:] = result.drafts.reshape(-1)
        dist.broadcast(buf, src=self.src, group=self.group)
        if result is not None:
            return result
        generation = int(buf[1])
        generation = None if generation == _NONE_GENERATION else generation
        drafts = buf[2:].view(batch, self.k).clone() if int(buf[0]) else None
        return DraftResult(drafts, generation)


def _checked(result: DraftResult, batch: int, k: int) -> DraftResult:
    """A malformed answer counts as no drafts (fail closed), never as a crash of the target."""
    d = result.drafts
    if d is not None and (tuple(d.shape) != (batch, k) or d.dtype not in (torch.int32, torch.int64)):
        return DraftResult(None, result.generation)
    if d is not None:
        d = d.to("cpu", torch.int64)
    return DraftResult(d, result.generation)
