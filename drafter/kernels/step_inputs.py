"""The index work of every chain step, in one launch per KV group for the whole chain.

For every request row: position + 1; a position at or past max_model_len is fed as 0 with
seq_len 1 and writes nothing (slot -1), as drafter.engine.proposer describes; padded rows (seq_len
0 in the static buffers) keep seq_len 0 and write nothing.  Done in torch this is a dozen
tiny launches per step; inside the captured draft loop each would cost a kernel slot.  None of
it depends on what the steps draft (step s sits at the first pass's position + s), so the
chain computes all its steps' inputs in one launch before its first step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drafter.attention.metadata import PADDING_SLOT_ID, AttentionMetadata

PAD_SLOT = tl.constexpr(PADDING_SLOT_ID)  # globals a kernel reads must be constexpr


@triton.jit(do_not_specialize=["batch", "max_model_len"])
def decode_step_inputs_kernel(
    pos_ptr,  # [batch] int64: the position before the first of these steps (unclamped)
    real_ptr,  # [batch] int32: the first pass's seq_lens; 0 = padded row
    table_ptr, stride_table,  # [batch, max_blocks] int32
    next_pos_ptr,  # [steps, batch] int64 out: pos + 1 + step
    fed_pos_ptr,  # [steps, batch] int64 out: the position the head is fed (0 past max_model_len)
    seq_lens_ptr,  # [steps, batch] int32 out
    qsl_ptr,  # [batch + 1] int32 out: one query row per request (the same for every step)
    slot_ptr,  # [steps, batch] int64 out
    batch, max_model_len,
    BLOCK_SIZE: tl.constexpr, WRITE_COMMON: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    step = tl.program_id(1)
    ok = rows < batch
    pos = tl.load(pos_ptr + rows, mask=ok, other=0) + 1 + step
    out = step * batch + rows
    real = tl.load(real_ptr + rows, mask=ok, other=0) > 0
    exceeds = pos >= max_model_len
    fed = tl.where(exceeds, 0, pos)
    live = real & ~exceeds
    block = tl.load(table_ptr + rows * stride_table + fed // BLOCK_SIZE, mask=ok & live, other=0).to(tl.int64)
    slot = tl.where(live, block * BLOCK_SIZE + fed % BLOCK_SIZE, PAD_SLOT)
    tl.store(slot_ptr + out, slot, mask=ok)
    if WRITE_COMMON:
        tl.store(next_pos_ptr + out, pos, mask=ok)
        tl.store(fed_pos_ptr + out, fed, mask=ok)
        seq = tl.where(real, tl.where(exceeds, 1, pos + 1), 0)
        tl.store(seq_lens_ptr + out, seq.to(tl.int32), mask=ok)
        first = (tl.zeros_like(rows) + step) == 0  # a row mask: the interpreter wants one
        tl.store(qsl_ptr + rows, rows.to(tl.int32), mask=ok & first)
        end = tl.zeros_like(rows) + batch  # qsl[batch] = batch, written by row 0 alone
        tl.store(qsl_ptr + end, end.to(tl.int32), mask=(rows == 0) & first)


def decode_step_inputs(
    pos: torch.Tensor,  # [batch] int64, the position before the first step
    real_seq_lens: torch.Tensor,  # [batch] int32, 0 = padded row
    block_tables: list[torch.Tensor],  # per KV group: [batch, max_blocks] int32
    block_sizes: tuple[int, ...],
    max_model_len: int,
    steps: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]]:
    """Per step s = 1 .. steps: (position, fed position, one AttentionMetadata per KV group)."""
    batch = pos.shape[0]
    dev = pos.device
    pos, real_seq_lens = pos.contiguous(), real_seq_lens.contiguous()
    next_pos = torch.empty(steps, batch, dtype=torch.int64, device=dev)
    fed = torch.empty(steps, batch, dtype=torch.int64, device=dev)
    seq_lens = torch.empty(steps, batch, dtype=torch.int32, device=dev)
    qsl = torch.empty(batch + 1, dtype=torch.int32, device=dev)
    block = min(1024, triton.next_power_of_2(batch))
    slots = []
    for g, (table, bs) in enumerate(zip(block_tables, block_sizes)):
        slots.append(torch.empty(steps, batch, dtype=torch.int64, device=dev))
        decode_step_inputs_kernel[(triton.cdiv(batch, block), steps)](
            pos, real_seq_lens, table, table.stride(0), next_pos, fed, seq_lens, qsl, slots[g],
            batch, max_model_len, BLOCK_SIZE=bs, WRITE_COMMON=g == 0, BLOCK=block, num_warps=1)
    return [(next_pos[s], fed[s], [
        AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens[s], block_table=table, slot_mapping=slots[g][s],
                          block_size=bs) for g, (table, bs) in enumerate(zip(block_tables, block_sizes))])
        for s in range(steps)]
