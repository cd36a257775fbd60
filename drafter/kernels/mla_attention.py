"""Paged attention over MLA's compressed cache in absorbed form, as one Triton kernel.

One program handles one query token and a block of BLOCK_H heads: it finds its request by a
binary search over query_start_loc, then streams its request's cache entries (latent c_kv and
rotated k_pe per token, found through the block table) in tiles of BLOCK_N tokens with an online
softmax.  Every head reads the same entries, so heads are batched into one tl.dot:
    score = q_latent . c_kv + q_rope . k_pe  (x scale),   out = sum softmax(score) c_kv
The visible keys are the request's logical indices [0, seq_len - query_len + j] for its j-th
query token (drafter.attention.reference's causal rule); tokens after the batch, requests of no
query and tokens with no visible key get zeros.  The grid depends on shapes only, and no value is
read on the host: launches can be captured in CUDA graphs.  Draft-tree masks are not handled here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 16  # heads per program: the smallest tile tl.dot takes
BLOCK_N = 32  # cache entries per tile


@triton.jit
def _request_of(qsl_ptr, token, num_reqs):
    """Largest r in [0, num_reqs) with qsl[r] <= token (requests of no query come before their successor)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_reqs"])
def mla_attention_kernel(
    q_ptr, stride_qt, stride_qh,  # [num_tokens, num_heads, LATENT + ROPE]
    cache_ptr, stride_cs,  # [num_blocks * block_size, LATENT + ROPE] (one row per cache slot)
    qsl_ptr, seq_lens_ptr,  # [num_reqs + 1] int32, [num_reqs] int32
    table_ptr, stride_table,  # [num_reqs, max_blocks] int32
    out_ptr, stride_ot, stride_oh,  # [num_tokens, num_heads, LATENT]
    num_reqs, num_heads, scale,
    PAGE: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr, LATENT_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    lat = tl.arange(0, LATENT_PAD)
    rot = tl.arange(0, ROPE_PAD)
    lat_ok = lat < LATENT
    rot_ok = rot < ROPE
    r = _request_of(qsl_ptr, token, num_reqs)
    start = tl.load(qsl_ptr + r)
    query_len = tl.load(qsl_ptr + r + 1) - start
    num_keys = tl.load(seq_lens_ptr + r) - query_len + (token - start) + 1
    num_keys = tl.where(token < tl.load(qsl_ptr + num_reqs), num_keys, 0)  # tokens after the batch
    q_row = q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + lat[None, :], mask=h_ok[:, None] & lat_ok[None, :], other=0.0)
    q_rot = tl.load(q_row + LATENT + rot[None, :], mask=h_ok[:, None] & rot_ok[None, :], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT_PAD], dtype=tl.float32)
    for first in range(0, num_keys, BLOCK_N):
        idx = first + tl.arange(0, BLOCK_N)
        k_ok = idx < num_keys
        block = tl.load(table_ptr + r.to(tl.int64) * stride_table + idx // PAGE, mask=k_ok, other=0)
        rows = cache_ptr + (block.to(tl.int64) * PAGE + idx % PAGE)[:, None] * stride_cs
        k_lat = tl.load(rows + lat[None, :], mask=k_ok[:, None] & lat_ok[None, :], other=0.0)
        k_rot = tl.load(rows + LATENT + rot[None, :], mask=k_ok[:, None] & rot_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
            s += tl.dot(q_rot, tl.trans(k_rot), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(k_lat)) + tl.dot(q_rot, tl.trans(k_rot))
        s = tl.where(k_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, k_lat, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_row = out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + lat[None, :]
    tl.store(out_row, out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & lat_ok[None, :])


def mla_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, latent + rope], absorbed query
    cache: torch.Tensor,  # [num_blocks, block_size, latent + rope]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    scale: float,
    latent_dim: int,
) -> torch.Tensor:  # [num_tokens, num_heads, latent_dim], q's dtype
    n, heads, width = q.shape
    out = torch.empty(n, heads, latent_dim, dtype=q.dtype, device=q.device)
    if n == 0 or seq_lens.shape[0] == 0:
        return out.zero_()
    q = q.contiguous()
    flat = cache.view(-1, width)
    rope = width - latent_dim
    grid = (n, triton.cdiv(heads, BLOCK_H))
    mla_attention_kernel[grid](
        q, q.stride(0), q.stride(1), flat, flat.stride(0), query_start_loc, seq_lens, block_table,
        block_table.stride(0), out, out.stride(0), out.stride(1), seq_lens.shape[0], heads, scale,
        PAGE=cache.shape[1], LATENT=latent_dim, ROPE=rope, LATENT_PAD=triton.next_power_of_2(max(latent_dim, 16)),
        ROPE_PAD=triton.next_power_of_2(max(rope, 16)), BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32)
    return out
