"""Write per-token rows into a paged cache at their slots, skipping slot -1, in one Triton launch.

    cache.view(-1, width)[slot_mapping[t]] = rows[t]     for every t with slot_mapping[t] >= 0

Torch can only skip the padding slots by selecting the kept rows first (a host read of how many
there are), which a CUDA graph cannot capture; each program here copies one token's row or nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def write_rows_kernel(rows_ptr, stride_r, slots_ptr, cache_ptr, stride_c, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    cols = tl.arange(0, BLOCK)
    keep = cols < WIDTH
    row = tl.load(rows_ptr + token.to(tl.int64) * stride_r + cols, mask=keep)
    tl.store(cache_ptr + slot.to(tl.int64) * stride_c + cols, row.to(cache_ptr.dtype.element_ty), mask=keep)


def write_rows(
    cache: torch.Tensor,  # [num_blocks, block_size, width], contiguous
    rows: torch.Tensor,  # [num_tokens, width]
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = skip
) -> None:
    width = cache.shape[-1]
    if rows.shape[0] == 0:
        return
    rows = rows.contiguous()
    write_rows_kernel[(rows.shape[0],)](rows, rows.stride(0), slot_mapping, cache, width, WIDTH=width,
                                        BLOCK=triton.next_power_of_2(width))
