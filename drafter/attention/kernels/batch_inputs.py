"""Loading a propose call into the static buffers in one launch per KV group.

It does what StaticBuffers.load does (shift the input ids by one, put next_token_ids at the
sampled rows, derive the sampled rows from query_start_loc minus the rejected tokens when the
caller names none, pad every per-token row to slot -1 and every per-request row to an empty
request), but as one kernel instead of ~25 torch ops: what is left of a graph-replayed
propose on the host is this launch, one copy of the hidden states and the two replays.

Rows past the call's tokens keep stale hidden states (finite values from earlier calls or
zeros): they belong to no request, write no KV and are never sampled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drafter.attention.metadata import PADDING_SLOT_ID

PAD_SLOT = tl.constexpr(PADDING_SLOT_ID)  # globals a kernel reads must be constexpr


@triton.jit(do_not_specialize=["n", "b"])
def load_batch_kernel(
    ids_ptr, pos_in_ptr, next_ids_ptr,  # [n], [n], [b] int
    qsl_in_ptr, seq_in_ptr,  # [b + 1], [b] int
    sample_in_ptr, rejected_ptr,  # [b] int each, optional (HAS_SAMPLE / HAS_REJECTED)
    slots_in_ptr,  # [n] int: this group's slot mapping
    table_in_ptr, stride_tin, width_in,  # [b, width_in] int: this group's block table
    input_ids_ptr, positions_ptr, qsl_ptr, seq_lens_ptr, sample_ptr,  # static buffers (COMMON only)
    slots_ptr,  # [max_tokens] int64
    table_ptr, stride_t, width,  # [max_batch, width] int32
    n, b, num_tokens, num_reqs,  # call sizes, padded sizes
    COMMON: tl.constexpr, HAS_SAMPLE: tl.constexpr, HAS_REJECTED: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK + tl.arange(0, BLOCK)

    # ---- per token row, up to the padded token count
    tok_ok = rows < num_tokens
    live = rows < n
    slots = tl.load(slots_in_ptr + rows, mask=live, other=PAD_SLOT).to(tl.int64)
    tl.store(slots_ptr + rows, slots, mask=tok_ok)
    if COMMON:
        tl.store(positions_ptr + rows, tl.load(pos_in_ptr + rows, mask=live, other=0).to(tl.int64), mask=tok_ok)
        # each row's request: the last r with qsl[r] <= row (binary search, one lane per row)
        lo = tl.zeros([BLOCK], tl.int32)
        hi = tl.zeros([BLOCK], tl.int32) + b
        for _ in range(SEARCH_STEPS):
            active = lo < hi
            mid = (lo + hi + 1) // 2
            start = tl.load(qsl_in_ptr + mid, mask=active, other=0)
            go_right = active & (start <= rows)
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(active & ~go_right, mid - 1, hi)
        req = lo
        if HAS_SAMPLE:
            sampled = tl.load(sample_in_ptr + req, mask=live, other=-1)
        else:
            sampled = tl.load(qsl_in_ptr + req + 1, mask=live, other=0) - 1
            if HAS_REJECTED:
                sampled -= tl.load(rejected_ptr + req, mask=live, other=0)
        shifted = tl.load(ids_ptr + rows + 1, mask=rows + 1 < n, other=0).to(tl.int64)
        bonus = tl.load(next_ids_ptr + req, mask=live, other=0).to(tl.int64)
        tl.store(input_ids_ptr + rows, tl.where(live & (rows == sampled), bonus, shifted), mask=tok_ok)

    # ---- per request row, up to the padded batch
    req_ok = rows < num_reqs
    real = rows < b
    if COMMON:
        qsl = tl.load(qsl_in_ptr + rows, mask=rows <= b, other=n)
        tl.store(qsl_ptr + rows, qsl.to(tl.int32), mask=rows <= num_reqs)
        tl.store(seq_lens_ptr + rows, tl.load(seq_in_ptr + rows, mask=real, other=0).to(tl.int32), mask=req_ok)
        if HAS_SAMPLE:
            sample = tl.load(sample_in_ptr + rows, mask=real, other=0)
        else:
            sample = tl.load(qsl_in_ptr + rows + 1, mask=real, other=1) - 1
            if HAS_REJECTED:
                sample -= tl.load(rejected_ptr + rows, mask=real, other=0)
        tl.store(sample_ptr + rows, tl.where(real, sample, 0).to(tl.int64), mask=req_ok)
    for c in range(0, width, BLOCK_W):
        cols = c + tl.arange(0, BLOCK_W)
        src_ok = real[:, None] & (cols < width_in)[None, :]
        entry = tl.load(table_in_ptr + rows[:, None] * stride_tin + cols[None, :], mask=src_ok, other=0)
        tl.store(table_ptr + rows[:, None] * stride_t + cols[None, :], entry.to(tl.int32),
                 mask=req_ok[:, None] & (cols < width)[None, :])


def load_batch(buf, inp, num_tokens: int, num_reqs: int) -> None:
    """StaticBuffers.load(inp, num_tokens, num_reqs) for greedy calls (temperatures untouched);
    every tensor of `inp` must already be on the buffers' device."""
    n, b = inp.num_tokens, inp.batch_size
    flat = [t.contiguous() if t is not None else None for t in (  # the kernel reads element i at ptr + i
        inp.target_token_ids, inp.target_positions, inp.next_token_ids, inp.query_start_loc, inp.seq_lens,
        inp.token_indices_to_sample, inp.num_rejected_tokens)]
    ids, positions, next_ids, qsl, seq_lens, sample, rejected = flat
    block = 128
    grid = (triton.cdiv(max(num_tokens, num_reqs + 1), block),)
    steps = int(num_reqs).bit_length() + 1  # a constant per engine: one compiled variant
    buf.hidden[:n].copy_(inp.target_hidden_states)
    for g, (table_in, slots_in) in enumerate(zip(inp.block_tables, inp.slot_mappings)):
        table, slots_in = buf.block_tables[g], slots_in.contiguous()
        if table_in.stride(1) != 1:
            table_in = table_in.contiguous()
        load_batch_kernel[grid](
            ids, positions, next_ids, qsl, seq_lens,
            sample if sample is not None else seq_lens, rejected if rejected is not None else seq_lens,
            slots_in, table_in, table_in.stride(0), table_in.shape[1],
            buf.input_ids, buf.positions, buf.query_start_loc, buf.seq_lens, buf.sample_indices,
            buf.slot_mappings[g], table, table.stride(0), table.shape[1],
            n, b, num_tokens, num_reqs,
            COMMON=g == 0, HAS_SAMPLE=sample is not None, HAS_REJECTED=rejected is not None,
            SEARCH_STEPS=steps, BLOCK=block, BLOCK_W=64, num_warps=4)
