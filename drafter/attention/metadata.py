"""Per-forward attention metadata for one KV cache group.

The convention is vLLM's: a request's query tokens are the *last* `query_len`
of its `seq_len` logical key positions, so query token j of a request with
query length q may see keys [0, seq_len - q + j].  Padded rows have
seq_len 0 and write nothing (slot -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PADDING_SLOT_ID = -1


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [batch + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [batch] int32, keys visible to each request
    block_table: torch.Tensor  # [batch, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = write nothing
    block_size: int
    # Tree steps: the last `tree_mask.shape[1]` keys of every request are
    # draft-tree nodes; a query sees them only where the mask says so.
    tree_mask: torch.Tensor | None = None  # [query_len, num_tree_nodes] bool
    tree_depths: torch.Tensor | None = None  # [num_tree_nodes] int, a node's position = context end + depth

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]
