"""Paged attention over MLA's compressed KV cache: its torch forms (what the kernels must match),
and the dispatch to drafter.kernels on a GPU.

A layer's cache is [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]: per token the
normed latent c_kv followed by the rotated k_pe, addressed by the same block tables and slot
mappings as every other KV group.  Attention runs in the absorbed form: the query arrives
already multiplied into latent space ([q_nope W_UK ; q_pe], the cache's width), every head
reads the one latent "key" per token, and the values are the latent part of the same entries,
so the output stays latent ([num_tokens, num_heads, kv_lora_rank]); W_UV is applied after.
"""

from __future__ import annotations

import torch

from drafter.attention.metadata import AttentionMetadata
from drafter.attention.reference import visible_keys


def write_latent(
    cache: torch.Tensor,  # [num_blocks, block_size, width]
    entries: torch.Tensor,  # [num_tokens, width]: c_kv then k_pe
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """On a GPU one Triton launch (graph-capturable); elsewhere torch, which selects the kept rows."""
    if cache.is_cuda:
        from drafter.kernels.latent_write import write_rows

        write_rows(cache, entries, slot_mapping)
        return
    flat = cache.view(-1, cache.shape[-1])
    keep = slot_mapping >= 0
    flat[slot_mapping[keep]] = entries[keep].to(cache.dtype)


def _request_slots(meta: AttentionMetadata, r: int, seq_len: int, device) -> torch.Tensor:  # [seq_len] int64
    idx = torch.arange(seq_len, device=device)
    blocks = meta.block_table[r, idx // meta.block_size].long()
    return blocks * meta.block_size + idx % meta.block_size


TOKEN_CHUNK = 64  # query tokens whose keys are gathered at once (bounds the gather's memory)


def paged_mla_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, width], width = latent + rope
    cache: torch.Tensor,  # [num_blocks, block_size, width]
    meta: AttentionMetadata,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:  # [num_tokens, num_heads, latent_dim], q's dtype
    """Softmax(q . entry * scale) over each query token's visible tokens, weighting their latents.

    Without a tree the work is laid out from tensor shapes only (each token finds its request by a
    search over query_start_loc), so no value is read on the host and a CUDA graph can capture it:
    on a GPU one Triton kernel, elsewhere torch gathers.  Tree steps take the per-request path."""
    if meta.tree_mask is not None:
        return paged_mla_attention_per_request(q, cache, meta, scale, latent_dim)
    if q.is_cuda:  # the same computation as one Triton kernel (drafter.kernels.mla_attention)
        from drafter.kernels.mla_attention import mla_attention

        return mla_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, scale, latent_dim)
    return paged_mla_attention_gathered(q, cache, meta, scale, latent_dim)


def paged_mla_attention_gathered(
    q: torch.Tensor,  # [num_tokens, num_heads, width]
    cache: torch.Tensor,  # [num_blocks, block_size, width]
    meta: AttentionMetadata,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:  # [num_tokens, num_heads, latent_dim]
    """The torch form of paged_mla_attention without a tree: every token gathers its request's
    whole block-table row (memory grows with max_model_len; the GPU uses the kernel instead)."""
    starts = meta.query_start_loc.long()
    tokens = torch.arange(q.shape[0], device=q.device)
    req = torch.searchsorted(starts[1:], tokens, right=True).clamp(max=starts.shape[0] - 2)  # [n]
    query_len = starts[req + 1] - starts[req]
    # the last logical key each token may read (-1: none; tokens past the batch read nothing)
    last = torch.where(tokens < starts[-1], meta.seq_lens.long()[req] - query_len + tokens - starts[req], -1)
    width = meta.block_table.shape[1] * meta.block_size
    keys = torch.arange(width, device=q.device)
    flat = cache.view(-1, cache.shape[-1])
    out = torch.empty(q.shape[0], q.shape[1], latent_dim, dtype=q.dtype, device=q.device)
    for lo in range(0, q.shape[0], TOKEN_CHUNK):
        hi = min(lo + TOKEN_CHUNK, q.shape[0])
        table = meta.block_table[req[lo:hi]].long()  # [chunk, max_blocks]
        slots = table[:, keys // meta.block_size] * meta.block_size + keys % meta.block_size  # [chunk, width]
        entries = flat[slots].float()  # [chunk, width, cache width]
        scores = torch.einsum("nhw,nkw->nhk", q[lo:hi].float(), entries) * scale
        allowed = keys[None, :] <= last[lo:hi, None]  # [chunk, width]
        probs = torch.softmax(scores.masked_fill(~allowed[:, None, :], float("-inf")), dim=-1)
        probs = torch.nan_to_num(probs)  # a token with no visible key reads nothing
        out[lo:hi] = torch.einsum("nhk,nkc->nhc", probs, entries[..., :latent_dim]).to(q.dtype)
    return out


def paged_mla_attention_per_request(
    q: torch.Tensor,  # [num_tokens, num_heads, width]
    cache: torch.Tensor,  # [num_blocks, block_size, width]
    meta: AttentionMetadata,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:  # [num_tokens, num_heads, latent_dim]
    """The same attention one request at a time, reading the metadata on the host (trees too)."""
    out = torch.zeros(q.shape[0], q.shape[1], latent_dim, dtype=q.dtype, device=q.device)
    flat = cache.view(-1, cache.shape[-1])
    starts = meta.query_start_loc.tolist()
    for r, seq_len in enumerate(meta.seq_lens.tolist()):
        q_start, q_end = starts[r], starts[r + 1]
        if q_end == q_start or seq_len == 0:
            continue  # padded request: reads nothing, outputs zeros
        entries = flat[_request_slots(meta, r, seq_len, q.device)].float()  # [seq_len, width]
        scores = torch.einsum("qhw,kw->hqk", q[q_start:q_end].float(), entries) * scale
        allowed = visible_keys(seq_len, q_end - q_start, None, meta.tree_mask, meta.tree_depths, q.device)
        probs = torch.nan_to_num(torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1))
        out[q_start:q_end] = torch.einsum("hqk,kc->qhc", probs, entries[:, :latent_dim]).to(q.dtype)
    return out
