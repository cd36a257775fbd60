"""The bound step guard (drafter.engine.step_guard) in a dozen launches instead of ~150 torch ops.

Each kernel checks one buffer of the target's step against the session's limits, writes the
masked copy the engine reads, and ORs the field's bit (1 << its index in guard_fields) into the error word (zeroed by the caller
first) when a live row was out of range.  The step's sizes come from two int64 words
in memory the device reads (num_tokens, then batch): the guard's own [2] tensor, or words N and B
of the engine's input header (drafter.kernels.batch_inputs, pinned host memory the host fills with
plain stores), so the launches are fixed and can be captured once, alone or at the start of the
engine's bound graphs (drafter.engine.bound.BoundPropose.fold).  The rules are
StepGuard.run_reference's, value for value: the tests compare both on every corrupt field.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _sizes(sizes_ptr):
    """(num_tokens, batch): words 0 and 1 (the header's N and B are its first two words)."""
    return tl.load(sizes_ptr).to(tl.int64), tl.load(sizes_ptr + 1).to(tl.int64)


@triton.jit
def _flag(err_ptr, wrong, bit):
    """OR `bit` (the field's 1 << index) into the error word when any lane of `wrong` is set."""
    hit = tl.max(wrong.to(tl.int32), axis=0) > 0
    tl.atomic_or(err_ptr, tl.where(hit, bit, 0).to(tl.int64))


@triton.jit
def range_kernel(src_ptr, out_ptr, capacity, sizes_ptr, err_ptr, bit, low, high, masked, padding,
                 BY_BATCH: tl.constexpr, HIGH_IS_TOKENS: tl.constexpr, BLOCK: tl.constexpr):
    """src, out: [capacity] int: rows past the size -> padding, rows outside [low, high) -> masked."""
    n, b = _sizes(sizes_ptr)
    size = b if BY_BATCH else n
    top = n if HIGH_IS_TOKENS else high
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < capacity
    t = tl.load(src_ptr + i, mask=inside, other=0).to(tl.int64)
    live = i < size
    wrong = live & ((t < low) | (t >= top))
    value = tl.where(wrong, masked, tl.where(live, t, padding))
    tl.store(out_ptr + i, value.to(out_ptr.dtype.element_ty), mask=inside)
    _flag(err_ptr, wrong & inside, bit)


@triton.jit
def finite_kernel(hidden_ptr, row_stride, width, bad_ptr, sizes_ptr, err_ptr, bit, BLOCK: tl.constexpr):
    """hidden: [rows, width] float; bad: [rows] int8, 1 where a live row holds a non-finite value."""
    n, b = _sizes(sizes_ptr)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    nonfinite = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, width, BLOCK):
        c = start + cols
        x = tl.load(hidden_ptr + row.to(tl.int64) * row_stride + c, mask=c < width, other=0.0).to(tl.float32)
        nonfinite |= ((x - x) != 0).to(tl.int32)  # inf - inf and nan - nan are nan
    bad = (tl.max(nonfinite, axis=0) > 0) & (row < n)
    tl.store(bad_ptr + row, bad.to(tl.int8))
    tl.atomic_or(err_ptr, tl.where(bad, bit, 0).to(tl.int64))


@triton.jit
def slots_kernel(src_ptr, out_ptr, capacity, bad_ptr, bad_rows, sizes_ptr, err_ptr, bit, limit, shift,
                 BLOCK: tl.constexpr):
    """src, out: [capacity] int slots; bad: [bad_rows] int8 from finite_kernel.  Live slots outside
    [-1, limit) are wrong; kept ones (in range, >= 0, finite row) move by shift, the rest -> -1."""
    n, b = _sizes(sizes_ptr)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < capacity
    t = tl.load(src_ptr + i, mask=inside, other=0).to(tl.int64)
    live = i < n
    wrong = live & ((t < -1) | (t >= limit))
    nonfinite = tl.load(bad_ptr + i, mask=inside & (i < bad_rows), other=0) != 0
    keep = live & ~wrong & (t >= 0) & ~nonfinite
    tl.store(out_ptr + i, tl.where(keep, t + shift, -1).to(out_ptr.dtype.element_ty), mask=inside)
    _flag(err_ptr, wrong & inside, bit)


@triton.jit
def table_kernel(src_ptr, out_ptr, numel, columns, sizes_ptr, err_ptr, bit, blocks, base, BLOCK: tl.constexpr):
    """src, out: [rows, columns] int, contiguous: live rows' ids outside [0, blocks) are wrong; every
    id kept in range (else 0) and moved by base."""
    n, b = _sizes(sizes_ptr)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < numel
    t = tl.load(src_ptr + i, mask=inside, other=0).to(tl.int64)
    live = (i // columns) < b
    wrong = live & ((t < 0) | (t >= blocks))
    tl.store(out_ptr + i, (tl.where(live & ~wrong, t, 0) + base).to(out_ptr.dtype.element_ty), mask=inside)
    _flag(err_ptr, wrong & inside, bit)


@triton.jit
def query_start_kernel(src_ptr, out_ptr, length, sizes_ptr, err_ptr, bit, BLOCK: tl.constexpr):
    """src, out: [length] int (one program, BLOCK >= length): 0 first, num_tokens at the batch and
    strictly increasing between, else one token a request (the last takes the rest); past the
    batch -> num_tokens."""
    n, b = _sizes(sizes_ptr)
    i = tl.arange(0, BLOCK)
    inside = i < length
    t = tl.load(src_ptr + i, mask=inside, other=0).to(tl.int64)
    nxt = tl.load(src_ptr + i + 1, mask=(i + 1) < length, other=0).to(tl.int64)
    first = tl.load(src_ptr).to(tl.int64)
    end_wrong = inside & (i == b) & (t != n)
    step_wrong = ((i + 1) < length) & ((i + 1) <= b) & ((nxt - t) < 1)
    wrong = (first != 0) | (tl.max((end_wrong | step_wrong).to(tl.int32), axis=0) > 0)
    fixed = tl.where(i < b, i.to(tl.int64), n)
    value = tl.where(wrong, fixed, tl.where(i <= b, t, n))
    tl.store(out_ptr + i, value.to(out_ptr.dtype.element_ty), mask=inside)
    tl.atomic_or(err_ptr, tl.where(wrong, bit, 0).to(tl.int64))


@triton.jit
def copy_sizes_kernel(src_ptr, dst_ptr):
    """dst[0:2] = src[0:2] (int64): the header's sizes into the torch reference guard's own."""
    tl.store(dst_ptr, tl.load(src_ptr))
    tl.store(dst_ptr + 1, tl.load(src_ptr + 1))
