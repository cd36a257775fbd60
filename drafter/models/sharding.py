"""Which slice of a tensor-parallel layer this process holds, and the collectives that join slices.

A Shard of world 1 is the single-process model: every collective is the identity.  With world
N the process group is torch.distributed's default (NCCL on GPUs, gloo on CPU); layers split
attention heads, experts and the vocabulary evenly and sum or gather partial results here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    world: int = 1

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ValueError(f"shard rank {self.rank} outside world {self.world}")

    def span(self, total: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's even share of `total` items (heads, experts, rows)."""
        if total % self.world:
            raise ValueError(f"{what}: {total} does not split evenly over {self.world} ranks")
        count = total // self.world
        return self.rank * count, count

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # [...], summed over ranks in place
        if self.world > 1:
            torch.distributed.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., world * d]
        if self.world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = Shard()
