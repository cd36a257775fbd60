"""Reference paged attention in plain torch: the behaviour every faster backend must match.

It is written for clarity (one request at a time), not speed, and it reads
`query_start_loc` / `seq_lens` on the host, so it cannot live inside a CUDA graph.
"""

from __future__ import annotations

import torch

from drafter.attention.metadata import AttentionMetadata


def write_kv(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat[0, slots] = k[keep].to(kv_cache.dtype)
    flat[1, slots] = v[keep].to(kv_cache.dtype)


def visible_keys(
    seq_len: int,
    query_len: int,
    sliding_window: int | None,
    tree_mask: torch.Tensor | None,  # [query_len, num_tree_nodes] bool
    tree_depths: torch.Tensor | None,  # [num_tree_nodes] int
    device: torch.device,
) -> torch.Tensor:  # [query_len, seq_len] bool
    """Which logical key positions each query token of one request may read.

    Without a tree, logical index = position.  Tree nodes sit after the context in the cache,
    but their positions are context end + depth, and the sliding window counts positions."""
    key_pos = torch.arange(seq_len, device=device)
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
    if tree_mask is None:
        allowed = key_pos[None, :] <= query_pos[:, None]
    else:
        num_nodes = tree_mask.shape[1]
        context = seq_len - num_nodes
        allowed = (key_pos < context)[None, :].expand(query_len, seq_len).clone()
        allowed[:, context:] = tree_mask
        depths = tree_depths.to(device)
        key_pos = torch.cat([key_pos[:context], context - 1 + depths])
        query_pos = context - 1 + depths[num_nodes - query_len:]
    if sliding_window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - sliding_window
    return allowed


class ReferenceBackend:
    name = "reference"

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotary applied
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.zeros_like(q)
        num_heads, head_dim = q.shape[1], q.shape[2]
        group = num_heads // kv_cache.shape[-2]
        scale = head_dim ** -0.5
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        for r, seq_len in enumerate(seq_lens):
            q_start, q_end = starts[r], starts[r + 1]
            query_len = q_end - q_start
            if query_len == 0 or seq_len == 0:
                continue  # padded request: reads nothing, outputs zeros
            idx = torch.arange(seq_len, device=q.device)
            blocks = meta.block_table[r, idx // meta.block_size].long()
            slots = blocks * meta.block_size + idx % meta.block_size
            keys = kv_cache[0].flatten(0, 1)[slots].repeat_interleave(group, dim=1)  # [seq_len, heads, dim]
            values = kv_cache[1].flatten(0, 1)[slots].repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end].float(), keys.float()) * scale
            allowed = visible_keys(seq_len, query_len, sliding_window, meta.tree_mask, meta.tree_depths, q.device)
            scores = scores.masked_fill(~allowed[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            probs = torch.nan_to_num(probs)  # a query row with no visible key reads nothing
            out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values.float()).to(q.dtype)
        return out
