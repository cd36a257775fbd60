"""Which slice of a tensor-parallel layer this process holds, and the collectives that join slices.

A Shard of world 1 is the single-process model: every collective is the identity.  With world
N the process group is torch.distributed's default (NCCL on GPUs, gloo on CPU); layers split
attention heads, experts and the vocabulary evenly and sum or gather partial results here.

Every collective here is safe inside a CUDA graph capture (drafter.engine.graphs captures the
sharded head with NCCL inside): outputs are allocated by torch ops on the capturing stream and
filled by one collective each, and nothing reads a device value on the host.  Greedy drafting
over a vocabulary split by rows needs no [tokens, vocab] gather: each rank's own top-1 (value,
global id) is gathered and the best kept (greedy_ids), with torch.argmax's tie rule.

`recording(calls)` lists each collective a forward issues (kind, shape, dtype), so a benchmark
can replay the step's collectives alone (drafter.tools.bench.tp's NCCL time per step).
"""

from __future__ import annotations

import contextlib
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
            _note("all_reduce", x)
            torch.distributed.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., world * d]
        if self.world == 1:
            return x
        stacked = self.all_gather_rows(x)  # [world, ..., d]
        return stacked.movedim(0, -2).reshape(*x.shape[:-1], self.world * x.shape[-1])

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:  # [...] -> [world, ...], rank order
        """Every rank's x stacked, by one collective into a tensor allocated here."""
        out = torch.empty((self.world, *x.shape), dtype=x.dtype, device=x.device)
        _note("all_gather", x)
        _gather_single(out.flatten(0, 1), x.contiguous())  # x: at least one dim
        return out

    def greedy_ids(self, local_logits: torch.Tensor) -> torch.Tensor:  # [n, V / world] -> [n] int64
        """argmax over the whole vocabulary of logits split by rows (this rank holds ids
        rank * V/world .. (rank + 1) * V/world - 1): each rank's top-1 value and global id, gathered;
        the largest value wins, ties to the lowest id, as torch.argmax over the gathered row does
        (ranks hold ascending id ranges and a rank's own argmax keeps its first maximum)."""
        local = local_logits.shape[-1]
        if self.world * local >= 1 << 24:
            raise ValueError(f"vocab_size {self.world * local}: ids from 2**24 up do not round-trip through float32")
        value, index = local_logits.max(dim=-1)
        if self.world == 1:
            return index
        mine = torch.stack((value.float(), (index + self.rank * local).float()), dim=-1)  # [n, 2]
        every = self.all_gather_rows(mine)  # [world, n, 2]
        best = every[..., 0].argmax(dim=0, keepdim=True)  # [1, n]: the first (lowest-id) rank at the max
        return every[..., 1].gather(0, best).squeeze(0).long()


SINGLE = Shard()

_recorder: list | None = None


def _note(kind: str, x: torch.Tensor) -> None:
    if _recorder is not None:
        _recorder.append((kind, tuple(x.shape), x.dtype))


@contextlib.contextmanager
def recording(calls: list):
    """Append (kind, shape, dtype) of every collective run inside the block to `calls`
    ("all_reduce": in place over x; "all_gather": x from every rank stacked)."""
    global _recorder
    previous, _recorder = _recorder, calls
    try:
        yield calls
    finally:
        _recorder = previous


def _gather_single(out: torch.Tensor, x: torch.Tensor) -> None:  # out [world * n, ...], x [n, ...]
    """torch.distributed's one-tensor all-gather (all_gather_single where this torch has it)."""
    gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    gather(out, x)


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
