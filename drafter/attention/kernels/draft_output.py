"""The loop graph's last kernel: the drafts go straight into the caller's output tensor.

The host allocates a fresh [batch, width] int64 tensor per call and puts its address into the
call's header (word OUT; word B is the real batch).  This kernel, captured at the end of each
draft-loop graph, stores rows [0, batch) of the loop's drafts there: no static drafts buffer,
no clone on the host, and the padded rows are never stored.  During capture the header is
neutral (batch 0, address 0): the kernel stores nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drafter.attention.kernels.batch_inputs import B, OUT


@triton.jit
def store_drafts_kernel(
    hdr_ptr,  # [header words] int64
    drafts_ptr, stride_d,  # [rows, width] int64: the loop's drafts (padded rows included)
    rows_captured, width,  # the padded batch the graph was captured for; drafts per request
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_W)
    batch = tl.load(hdr_ptr + B)
    out = tl.load(hdr_ptr + OUT).to(tl.pointer_type(tl.int64))  # an address: the caller's fresh tensor
    ok = ((rows < batch) & (rows < rows_captured))[:, None] & (cols < width)[None, :]
    ids = tl.load(drafts_ptr + rows[:, None] * stride_d + cols[None, :], mask=ok)
    tl.store(out + rows[:, None] * width + cols[None, :], ids, mask=ok)


def store_drafts(
    header: torch.Tensor,  # [header words] int64, where the drafts' device reads it
    drafts: torch.Tensor,  # [batch_padded, width] int64
) -> None:
    """Queue the store of the real rows of `drafts` into the output the header names."""
    rows, width = drafts.shape
    if drafts.stride(1) != 1:
        drafts = drafts.contiguous()
    block_r = min(64, triton.next_power_of_2(rows))
    store_drafts_kernel[(triton.cdiv(rows, block_r),)](
        header, drafts, drafts.stride(0), rows, width,
        BLOCK_R=block_r, BLOCK_W=triton.next_power_of_2(width), num_warps=1)
