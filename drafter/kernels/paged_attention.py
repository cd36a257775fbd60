"""Paged attention over the KV cache for every draft step shape, as one Triton kernel.

One program handles a block of query tokens of one request against one KV head (all the
query heads of that head's GQA group share the program, so K/V tiles are read once per
group) and one split of the key range.  Programs find their request by binary search over
`query_start_loc`, so the grid depends only on static sizes (num_tokens, num_reqs): the
launch needs no host copy of any tensor value and can live inside a CUDA graph.

Masking follows drafter.attention.reference.visible_keys: causal in logical key index,
optional sliding window in positions, optional draft-tree mask over the last nodes.

With several splits the programs write unnormalised partial results (acc, max, sum) and a
second kernel combines them (flash-decoding); with one split the output is written directly.
The tokens after the last request (padding) form a pseudo-request with no keys, so every
output row is written by exactly one program and no memset is needed.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_request(qsl_ptr, target, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest r in [0, num_reqs] whose first q-block index (qsl[r] // BLOCK_Q + r) <= target."""
    lo = 0
    hi = num_reqs + 1
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# sizes that vary per call stay runtime values: one compiled kernel serves every batch
@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "num_nodes", "window"])
def paged_attention_kernel(
    q_ptr, stride_qt, stride_qh,  # [num_tokens, num_heads, head_dim], last stride 1
    cache_ptr, stride_cb, stride_cs, stride_ch,  # keys at cache_ptr, values at cache_ptr + v_offset
    v_offset,
    qsl_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    table_ptr, stride_table,  # [num_reqs, max_blocks] int32
    mask_ptr, depths_ptr, num_nodes,  # tree: [query_len, num_nodes] bool/int8, [num_nodes] int
    out_ptr, stride_ot, stride_oh,  # NUM_SPLITS == 1: [num_tokens, num_heads, head_dim]
    part_ptr, ml_ptr,  # NUM_SPLITS > 1: [splits, num_tokens, num_heads, head_dim] f32, [splits, num_tokens, num_heads, 2] f32
    num_tokens, num_reqs, num_heads,
    scale, window,  # window <= 0: full attention
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IS_TREE: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    qblock = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = _find_request(qsl_ptr, qblock, num_reqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + req)
    local_block = qblock - (q_start // BLOCK_Q + req)
    is_pad = req >= num_reqs  # the rows after the last request: no keys, zero output
    q_end = tl.load(qsl_ptr + req + 1, mask=req < num_reqs, other=num_tokens)
    q_end = tl.where(is_pad, num_tokens, q_end)
    query_len = q_end - q_start
    if local_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req, mask=req < num_reqs, other=0)
    seq_len = tl.where(is_pad, 0, seq_len)
    context = seq_len - query_len  # logical index of the request's first query token

    offs_m = tl.arange(0, BLOCK_M)
    tok = local_block * BLOCK_Q + offs_m // GROUP_PAD  # query token within the request
    head_in_group = offs_m % GROUP_PAD
    row_ok = (tok < query_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)

    last_tok = tl.minimum(query_len, (local_block + 1) * BLOCK_Q) - 1
    if IS_TREE:
        tree_context = seq_len - num_nodes
        q_node = num_nodes - query_len + tok
        q_depth = tl.load(depths_ptr + q_node, mask=row_ok & (q_node >= 0), other=0)
        q_pos = tree_context - 1 + q_depth
        kv_end = seq_len
        kv_begin = 0
    else:
        q_pos = context + tok
        kv_end = context + last_tok + 1
        kv_begin = 0
        if HAS_WINDOW:
            first_tok = local_block * BLOCK_Q
            kv_begin = tl.maximum(context + first_tok - window + 1, 0)
            kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
    kv_end = tl.maximum(tl.minimum(kv_end, seq_len), 0)
    num_tiles = tl.cdiv(tl.maximum(kv_end - kv_begin, 0), BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2
    offs_n = tl.arange(0, BLOCK_N)
    for t in range(tile_lo, tile_hi):
        key = kv_begin + t * BLOCK_N + offs_n  # logical key index
        key_ok = key < kv_end
        block = tl.load(table_ptr + req * stride_table + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot_off = block * stride_cb + (key % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(cache_ptr + slot_off[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if IS_TREE:
            is_node = key >= tree_context
            node = tl.where(is_node, key - tree_context, 0)
            in_tree = tl.load(mask_ptr + tok[:, None] * num_nodes + node[None, :],
                              mask=row_ok[:, None] & is_node[None, :] & key_ok[None, :], other=0)
            allowed = (~is_node[None, :]) | (in_tree != 0)
            if HAS_WINDOW:
                k_depth = tl.load(depths_ptr + node, mask=is_node & key_ok, other=0)
                k_pos = tl.where(is_node, tree_context - 1 + k_depth, key)
                allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        else:
            allowed = key[None, :] <= q_pos[:, None]
            if HAS_WINDOW:
                allowed = allowed & (key[None, :] > q_pos[:, None] - window)
        allowed = allowed & key_ok[None, :] & row_ok[:, None]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + v_offset + slot_off[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    rows = q_start + tok
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no visible key: zeros, like the reference
        tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        base = (split * num_tokens + rows) * num_heads + head  # [BLOCK_M]
        tl.store(part_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + base * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + base * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_tokens"])
def combine_splits_kernel(
    part_ptr, ml_ptr,  # [splits, num_tokens, num_heads, head_dim] f32, [splits, num_tokens, num_heads, 2] f32
    out_ptr, stride_ot, stride_oh,  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS: tl.constexpr,
):
    tok = tl.program_id(0)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    h_ok = heads < num_heads
    splits = tl.arange(0, NUM_SPLITS)
    base = (splits[:, None] * num_tokens + tok) * num_heads + heads[None, :]  # [NUM_SPLITS, HEADS]
    m = tl.load(ml_ptr + base * 2, mask=h_ok[None, :], other=float("-inf"))
    l = tl.load(ml_ptr + base * 2 + 1, mask=h_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe[None, :])  # splits that saw nothing have m = -inf and weigh 0
    total = tl.sum(l * w, 0)  # [HEADS]
    offs_d = tl.arange(0, HEAD_DIM)
    seen = h_ok[None, :] & (l > 0)  # splits past a short context saw no key: skip their reads
    acc = tl.load(part_ptr + base[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=seen[:, :, None],
                  other=0.0)
    out = tl.sum(acc * w[:, :, None], 0) / tl.where(total > 0, total, 1.0)[:, None]  # [HEADS, HEAD_DIM]
    tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
