"""The loop graph's last kernel: the drafts go straight into the caller's output tensor.

The host allocates a fresh [batch, width] int64 tensor per call and puts its address into the
call's header (word OUT; word B is the real batch).  This kernel, captured at the end of each
draft-loop graph, stores rows [0, batch) of the loop's drafts there: no static drafts buffer,
no clone on the host, and the padded rows are never stored.  During capture the header is
neutral (batch 0, address 0): the kernel stores nothing.

It is the last kernel to read the header, and one program does all of it, so it can also tell
the host when the header may be rewritten (word DONE, see InputHeader): the value it stores
there is computed from every header word it loaded, so the store cannot issue before those
loads have returned (a GPU issues independent stores past pending loads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drafter.kernels.batch_inputs import B, DONE, OUT


@triton.jit
def store_drafts_kernel(
    hdr_ptr,  # [header words] int64
    drafts_ptr, stride_d,  # [rows, width] int64: the loop's drafts (padded rows included)
    rows_captured, width,  # the padded batch the graph was captured for; drafts per request
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_W)
    batch = tl.load(hdr_ptr + B)
    out_addr = tl.load(hdr_ptr + OUT)
    out = out_addr.to(tl.pointer_type(tl.int64))  # an address: the caller's fresh tensor
    real = tl.minimum(batch, rows_captured)
    for r0 in range(0, real, BLOCK_R):  # one program walks the real rows: it alone marks the header
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = (rows < real)[:, None] & (cols < width)[None, :]
        ids = tl.load(drafts_ptr + rows[:, None] * stride_d + cols[None, :], mask=ok)
        tl.store(out + rows[:, None] * width + cols[None, :], ids, mask=ok)
    # 1 for every header the host writes (batch >= 0, a real or null address), but not knowable
    # before both loads return: the store waits for them
    tl.store(hdr_ptr + DONE, tl.where((batch < 0) | (out_addr == -1), 0, 1).to(tl.int64))


def store_drafts(
    header: torch.Tensor,  # [header words] int64, where the drafts' device reads it
    drafts: torch.Tensor,  # [batch_padded, width] int64
) -> None:
    """Queue the store of the real rows of `drafts` into the output the header names, then
    mark the header read (word DONE)."""
    rows, width = drafts.shape
    if drafts.stride(1) != 1:
        drafts = drafts.contiguous()
    store_drafts_kernel[(1,)](
        header, drafts, drafts.stride(0), rows, width,
        BLOCK_R=min(64, triton.next_power_of_2(rows)), BLOCK_W=triton.next_power_of_2(width), num_warps=1)
