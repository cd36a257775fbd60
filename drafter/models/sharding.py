"""Which slice of a tensor-parallel layer this process holds, and the collectives that join slices.

A Shard of world 1 is the single-process model: every collective is the identity.  With world
N the process group is torch.distributed's default (NCCL on GPUs, gloo on CPU); layers split
attention heads, experts and the vocabulary evenly and sum or gather partial results here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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

    def kv_span(self, num_kv_heads: int, num_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank's query heads read.  Fewer KV heads than ranks:
        each rank keeps the one KV head its query heads share (replicated over world / num_kv_heads
        ranks), so the grouping of query heads onto KV heads is the single process's."""
        if num_kv_heads >= self.world or num_kv_heads == 0:
            return self.span(num_kv_heads, "num_key_value_heads")
        if self.world % num_kv_heads:
            raise ValueError(f"num_key_value_heads: {num_kv_heads} KV heads neither split evenly over nor "
                             f"replicate evenly onto {self.world} ranks")
        self.span(num_heads, "num_attention_heads")
        return self.rank * num_kv_heads // self.world, 1

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


def row_parallel(linear: nn.Linear, x: torch.Tensor, shard: Shard) -> torch.Tensor:  # [n, in / world] -> [n, out]
    """A linear whose input columns are split over ranks: partial products summed over ranks, the
    (replicated) bias added once after the sum.  World 1: the plain linear."""
    if shard.world == 1:
        return linear(x)
    y = shard.all_reduce(F.linear(x, linear.weight))
    return y if linear.bias is None else y + linear.bias


def column_parallel(linear: nn.Linear, x: torch.Tensor, shard: Shard) -> torch.Tensor:  # [n, in] -> [n, out]
    """A linear whose output rows are split over ranks: each rank's rows, gathered in rank order
    (every output element is one rank's whole dot product, so the result is the single process's)."""
    return shard.all_gather_last(linear(x))


class VocabEmbedding(nn.Module):
    """The token embedding, split by vocabulary rows over ranks (each rank looks up its own ids,
    the others contribute zeros to the sum)."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard):
        super().__init__()
        self.shard = shard
        self.start, local = shard.span(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.zeros(local, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden_size]
        if self.shard.world == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None].to(self.weight.dtype)
        return self.shard.all_reduce(out)


def embedding(vocab_size: int, hidden_size: int, shard: Shard) -> nn.Module:
    """nn.Embedding in one process (what the fused GPU path expects), VocabEmbedding over several."""
    if shard.world == 1:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabEmbedding(vocab_size, hidden_size, shard)
