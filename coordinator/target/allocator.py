"""The reference target's KV block allocator: a free list over one pool of block ids.

Block 0 is the null block, never handed out: block-table columns past a request's blocks hold 0
(as vLLM's do), so a read or write that strays there can never land in another request's KV.
The drafter's session pool mirrors these ids, so the same reasoning holds on its side.
"""

from __future__ import annotations

from collections import deque

NULL_BLOCK = 0


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        # lowest ids first: deterministic, so every TP rank (and a rerun) assigns the same blocks
        self._free = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        if any(b == NULL_BLOCK or not 0 < b < self.num_blocks for b in blocks):
            raise ValueError(f"cannot free {blocks}")
        self._free.extend(blocks)
