"""Writing a step's keys and values into the paged KV cache (slot -1 writes nothing).

`write_kv_kernel` takes keys that already carry the rotary embedding (the backend contract);
`rope_write_kernel` takes the fused q/k/v projection output, rotates q and k (neox style, every
rope type of drafter.models.rope, as its apply_rope) and writes k and v in the same pass, so the
decode step spends one launch instead of a dozen elementwise ones.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    k_ptr, stride_kt, stride_kh,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr, stride_vt, stride_vh,  # [num_tokens, num_kv_heads, head_dim]
    cache_ptr, stride_cb, stride_cs, stride_ch, v_offset,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_ptr,  # [num_tokens] int64, -1 = write nothing
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM)
    ok = (heads < num_kv_heads)[:, None]
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
        + heads[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=ok)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=ok)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + v_offset, v.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotate(x_ptr, heads, ok, pos, inv_freq_ptr, pos_div, magnitude, out_ty,
            HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr):
    """Neox rotary on [heads, HEAD_DIM] rows (drafter.models.rope): the first 2 * ROT_HALF
    dimensions in halves, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); the rest pass through.
    cos / sin = cos(angle) * magnitude rounded to out_ty (as vLLM's table in the model dtype),
    angle = (pos / pos_div) * inv_freq.  Returns the f32 rows."""
    d = tl.arange(0, HEAD_DIM)
    rotated = d < 2 * ROT_HALF
    first = d < ROT_HALF
    j = tl.where(first, d, d - ROT_HALF)
    partner = tl.where(first, d + ROT_HALF, d - ROT_HALF)
    inv = tl.load(inv_freq_ptr + j, mask=rotated, other=0.0)
    angle = (pos / pos_div) * inv
    cos = (tl.cos(angle) * magnitude).to(out_ty).to(tl.float32)
    sin = (tl.sin(angle) * magnitude).to(out_ty).to(tl.float32)
    cos = tl.where(rotated, cos, 1.0)[None, :]
    sin = tl.where(rotated, tl.where(first, -sin, sin), 0.0)[None, :]
    x = tl.load(x_ptr + d[None, :], mask=ok).to(tl.float32)
    xp = tl.load(x_ptr + partner[None, :], mask=ok & rotated[None, :], other=0.0).to(tl.float32)
    return x * cos + xp * sin


@triton.jit
def rope_write_kernel(
    qkv_ptr, stride_t,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]: q | k | v
    pos_ptr,  # [num_tokens] int
    inv_freq_ptr,  # [rotary_dim // 2] f32, drafter.models.rope's table
    pos_div, magnitude,  # f32 scalars of drafter.models.rope.RopeTables
    q_out_ptr,  # [num_tokens, num_heads, head_dim], contiguous
    cache_ptr, stride_cb, stride_cs, stride_ch, v_offset,
    slot_ptr,  # [num_tokens] int64, -1 = write nothing
    num_heads, num_kv_heads,
    BLOCK_SIZE: tl.constexpr, Q_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr,
):
    """Program (t, j): query heads [j * Q_HEADS, (j + 1) * Q_HEADS) of token t, or, for the last j,
    its keys (rotated) and values, written into the cache."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    row = qkv_ptr + t.to(tl.int64) * stride_t
    d = tl.arange(0, HEAD_DIM)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    out_ty = q_out_ptr.dtype.element_ty
    if j * Q_HEADS < num_heads:
        qh = j * Q_HEADS + tl.arange(0, Q_HEADS)
        q_ok = (qh < num_heads)[:, None]
        r = _rotate(row + qh[:, None] * HEAD_DIM, qh, q_ok, pos, inv_freq_ptr, pos_div, magnitude, out_ty,
                    HEAD_DIM, ROT_HALF)
        q_dst = q_out_ptr + t.to(tl.int64) * num_heads * HEAD_DIM + qh[:, None] * HEAD_DIM + d[None, :]
        tl.store(q_dst, r.to(out_ty), mask=q_ok)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            kh = tl.arange(0, KV_HEADS_PAD)
            k_ok = (kh < num_kv_heads)[:, None]
            k_row = row + num_heads * HEAD_DIM
            r = _rotate(k_row + kh[:, None] * HEAD_DIM, kh, k_ok, pos, inv_freq_ptr, pos_div, magnitude, out_ty,
                        HEAD_DIM, ROT_HALF)
            dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
                + kh[:, None] * stride_ch + d[None, :]
            ty = cache_ptr.dtype.element_ty
            # the reference rounds rotated keys to the activation dtype before the cache stores them
            tl.store(dst, r.to(out_ty).to(ty), mask=k_ok)
            v_row = k_row + num_kv_heads * HEAD_DIM
            v = tl.load(v_row + kh[:, None] * HEAD_DIM + d[None, :], mask=k_ok)
            tl.store(dst + v_offset, v.to(ty), mask=k_ok)
