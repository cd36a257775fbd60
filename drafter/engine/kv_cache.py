"""Paged KV cache groups (one tensor per head layer) and the paged hidden-state store.

A group is the set of layers that share a block size, block table and slot mapping (e.g.
full-attention layers in one group, sliding-window layers in another).  Block ids index
this pool directly, so a session's pool mirrors the target's block-id space.
"""

from __future__ import annotations

import torch

from drafter.engine.config import KVGroupSpec
from drafter.models.layers import LayerShape


def _layer_cache_shape(shape, group: KVGroupSpec) -> tuple[int, ...]:
    """[2 (k, v), num_blocks, block_size, num_kv_heads, head_dim], or the layer's own layout where its
    shape defines one (MLA's compressed [num_blocks, block_size, kv_lora_rank + rope])."""
    own = getattr(shape, "kv_cache_shape", None)
    if own is not None:
        return own(group.num_blocks, group.block_size)
    return 2, group.num_blocks, group.block_size, shape.num_kv_heads, shape.head_dim


class PagedKVCache:
    def __init__(
        self,
        layer_shapes: tuple[LayerShape, ...],
        kv_group_of_layer: tuple[int, ...],
        groups: tuple[KVGroupSpec, ...],
        device: torch.device,
        dtype: torch.dtype,
    ):
        used = sorted(set(kv_group_of_layer))
        if used and used != list(range(len(groups))):
            raise ValueError(f"the head's layers use KV groups {used} but {len(groups)} kv_groups were configured")
        self.groups = groups
        self.kv_group_of_layer = kv_group_of_layer
        self.layers = [
            torch.zeros(_layer_cache_shape(s, groups[g]), device=device, dtype=dtype)
            for s, g in zip(layer_shapes, kv_group_of_layer)
        ]

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(g.block_size for g in self.groups)

    @property
    def num_blocks(self) -> tuple[int, ...]:
        return tuple(g.num_blocks for g in self.groups)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.layers]

    def zero_blocks(self, group: int, block_ids: torch.Tensor) -> None:
        """Forget what a released session left behind in these blocks."""
        for t, g in zip(self.layers, self.kv_group_of_layer):
            if g == group:
                t.index_fill_(1 if t.dim() == 5 else 0, block_ids.to(t.device).long(), 0)  # the blocks dim


class HiddenStateStore:
    """extract_hidden_states: every token's aux hidden states, paged like KV and addressed by slot."""

    def __init__(self, spec: KVGroupSpec, num_aux: int, hidden_size: int, device, dtype):
        self.block_size = spec.block_size
        # [num_blocks, block_size, num_aux, hidden_size]
        self.states = torch.zeros(spec.num_blocks, spec.block_size, num_aux, hidden_size, device=device, dtype=dtype)

    def write(self, hidden: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # hidden: [num_tokens, num_aux * hidden_size]; slot_mapping: [num_tokens], -1 = skip
        flat = self.states.view(-1, *self.states.shape[2:])
        keep = slot_mapping >= 0
        flat[slot_mapping[keep]] = hidden[keep].view(-1, *self.states.shape[2:]).to(flat.dtype)

    def read(self, block_table_row: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """A request's stored states for positions [0, num_tokens): [num_tokens, num_aux, hidden_size]."""
        idx = torch.arange(num_tokens, device=self.states.device)
        blocks = block_table_row.to(self.states.device).long()[idx // self.block_size]
        return self.states.view(-1, *self.states.shape[2:])[blocks * self.block_size + idx % self.block_size]

    def snapshot(self) -> list[torch.Tensor]:
        return [self.states.clone()]
