"""Paged attention over the KV cache for every draft step shape, as one Triton kernel.

One program handles a block of query tokens of one request against one KV head (all the
query heads of that head's GQA group share the program, so K/V tiles are read once per
group) and one split of the key range.  Programs find their request by binary search over
`query_start_loc`, so the grid depends only on static sizes (num_tokens, num_reqs): the
launch needs no host copy of any tensor value and can live inside a CUDA graph.

Masking follows drafter.attention.reference.visible_keys: causal in logical key index,
optional sliding window in positions, optional draft-tree mask over the last nodes.

With one split the output is written directly.  With several (flash-decoding) each program
writes its unnormalised partial result (acc, max, sum) to scratch and then arrives on a counter
of its (q-block, kv head); the program that arrives last combines every split's partials and
writes the output, in the same launch (no second kernel: a launch costs microseconds inside a
CUDA graph, and the draft loop is latency-bound).  That program also puts the counter back to
0, so every launch, and every replay of a graph holding one, starts from zeros.

Memory ordering of the arrival (GPU): the CTA barrier before the atomic orders every thread's
partial stores before it; the atomic is acq_rel at gpu scope (release publishes this program's
partials, acquire makes the others' visible to the last one); its result reaches the other
threads through shared memory behind a barrier; the last program reads the partials with
.cg loads (L2, bypassing an L1 that may hold lines of the same cache line read earlier).

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
    out_ptr, stride_ot, stride_oh,  # [num_tokens, num_heads, head_dim]
    part_ptr, ml_ptr,  # NUM_SPLITS > 1: [splits, num_tokens, num_heads, head_dim] f32, [splits, num_tokens, num_heads, 2] f32
    counter_ptr,  # NUM_SPLITS > 1: [>= grid(0) * grid(1)] int32, all 0 before the launch (and after it)
    num_tokens, num_reqs, num_heads,
    scale, window,  # window <= 0: full attention
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, COMBINE_UNROLL: tl.constexpr,  # splits whose loads the combine keeps in flight
    IS_TREE: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
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
        # splits past the last key tile hold nothing: they store nothing, the combine reads the first n_active
        n_active = tl.where(tiles_per_split > 0, tl.cdiv(num_tiles, tl.maximum(tiles_per_split, 1)), 0)
        keep = (tok < tl.where(split < n_active, query_len, 0)) & (head_in_group < GROUP)  # row_ok, if active
        base = (split * num_tokens + rows) * num_heads + head  # [BLOCK_M]
        tl.store(part_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=keep[:, None])
        tl.store(ml_ptr + base * 2, m_i, mask=keep)
        tl.store(ml_ptr + base * 2 + 1, l_i, mask=keep)

        # Arrive.  Every split of this block gets here (the early return above is the same for
        # all of them), so the counter reaches NUM_SPLITS exactly once per launch.
        tl.debug_barrier()  # all threads' partial stores come before the release below
        counter = counter_ptr + qblock * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:  # the last one: every split's partials are visible now
            _combine_splits(part_ptr, ml_ptr, out_ptr, stride_ot, stride_oh, q_start, local_block, query_len,
                            kv_head, n_active, num_tokens, num_heads,
                            GROUP, GROUP_PAD, BLOCK_Q, HEAD_DIM, COMBINE_UNROLL)
            tl.store(counter, 0)  # clean for the next launch / graph replay (no other split touches it now)


@triton.jit
def _combine_splits(
    part_ptr, ml_ptr,  # [splits, num_tokens, num_heads, head_dim] f32, [splits, num_tokens, num_heads, 2] f32
    out_ptr, stride_ot, stride_oh,  # [num_tokens, num_heads, head_dim]
    q_start, local_block, query_len, kv_head, n_active, num_tokens, num_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    COMBINE_UNROLL: tl.constexpr,
):
    """Output rows of one (q-block, kv head) from the partials of its first n_active splits:
    sum over splits of acc * 2^(m - M) / sum of l * 2^(m - M), M the rows' max over splits
    (a running max: earlier splits are rescaled when it grows).  Splits that saw no key
    (l == 0, m == -inf) weigh 0; rows that saw none get zeros.  As combine_splits_kernel did.

    One token at a time (a decode block has one) and one split at a time, on [GROUP_PAD,
    HEAD_DIM] tiles, m and l loaded broadcast over head_dim: every step is elementwise in one
    layout (no reduction, no layout change, so no barrier in the loop), and the unrolled loop
    keeps COMBINE_UNROLL splits' loads in flight.  Loads are .cg: other SMs wrote the partials."""
    offs_g = tl.arange(0, GROUP_PAD)
    g_ok = offs_g < GROUP
    heads = kv_head * GROUP + offs_g  # [GROUP_PAD]
    # One layout for all the loop's tiles.  A layout change inside the loop is a shared-memory
    # round trip behind a barrier, and the barrier waits out each split's loads in turn (seen on
    # an H100 with Triton 3.6: the combine took ~0.3 us a split).  The compiler picks a load's
    # layout from what it can prove of the addresses, so both the m/l addresses (the same along
    # head_dim) and the partials' (contiguous along it) are built from offs_d times an opaque
    # runtime factor (0 and 1): nothing is known of either, and they get the same layout.
    zero = (num_tokens < 0).to(tl.int32)  # 0, opaque to the compiler
    offs_d = tl.arange(0, HEAD_DIM)
    d_part = offs_d[None, :] * (1 - zero)  # [1, HEAD_DIM]: offs_d
    d_ml = offs_d[None, :] * zero  # [1, HEAD_DIM]: 0
    ok2 = g_ok[:, None] & (d_part < HEAD_DIM)  # [GROUP_PAD, HEAD_DIM]
    first = local_block * BLOCK_Q
    for t in range(0, tl.minimum(query_len - first, BLOCK_Q)):
        row = q_start + first + t
        m_run = tl.full([GROUP_PAD, HEAD_DIM], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        o = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for s in tl.range(0, n_active, loop_unroll_factor=COMBINE_UNROLL):
            base = (s * num_tokens + row) * num_heads + heads  # [GROUP_PAD]
            ml = ml_ptr + base[:, None] * 2 + d_ml  # [GROUP_PAD, HEAD_DIM], the same address along head_dim
            m = tl.load(ml, mask=ok2, other=float("-inf"), cache_modifier=".cg")
            l = tl.load(ml + 1, mask=ok2, other=0.0, cache_modifier=".cg")
            a = tl.load(part_ptr + base[:, None] * HEAD_DIM + d_part, mask=ok2, other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_run, m)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_run - m_safe)  # earlier splits, rescaled to the new max (0 while none seen)
            w = tl.where(l > 0, tl.exp2(m - m_safe), 0.0)  # a split that saw nothing weighs 0
            total = total * alpha + l * w
            o = o * alpha + tl.where(l > 0, a * w, 0.0)
            m_run = m_new
        o = o / tl.where(total > 0, total, 1.0)  # no visible key: zeros, like the reference
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
