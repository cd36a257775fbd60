"""Programmatic dependent launch (PDL): the next kernel of a draft step starts while this one drains.

A draft step at small batch is a chain of short kernels, each waiting for the one before.
Between two plain launches the GPU drains the first grid, flushes, then launches and ramps up
the second: a few microseconds per boundary during which device memory sits idle, about ten
boundaries per step.  On Hopper a kernel launched with PDL may be scheduled as soon as every
program of the kernel before it has signalled `allow_next_kernel`; it then does work that
depends on nothing the earlier kernel writes (pulling its own weights into L2) and calls
`wait_previous_kernel` before it touches anything else.  That wait returns once the earlier
grid has completed and its writes are visible, so the data flow is the same as with plain
launches; only the dead time between them shrinks.  Inside a CUDA graph the launch attribute
becomes a programmatic edge.

Rules every kernel launched with `launch_pdl=True` follows (all in the kernel's first lines):
    allow_next_kernel(PDL)       # the next kernel may be scheduled once all our programs started
    ...reads of weights only...  # never anything an earlier kernel writes, never a store
    wait_previous_kernel(PDL)    # from here on the kernel is ordered as with a plain launch
A plain launch (PDL False, the CPU interpreter, pre-Hopper GPUs) compiles both calls away.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def supported(device: torch.device) -> bool:
    """PDL needs a Hopper-or-newer CUDA device and Triton's grid-dependency intrinsics."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(mode: str, device: torch.device) -> bool:
    """EngineConfig.pdl ("auto" | "on" | "off") -> whether kernels launch with PDL on `device`."""
    if mode == "off":
        return False
    ok = supported(device)
    if mode == "on" and not ok:
        raise ValueError(f"pdl=on needs a Hopper (sm_90+) CUDA device and Triton's gdc intrinsics, got {device}")
    return ok


@triton.jit
def allow_next_kernel(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_previous_kernel(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_rows_l2(row_ptrs, ok, nbytes):
    """Ask the copy engine to pull the first `nbytes` of each row into L2 (Hopper's bulk L2
    prefetch: one instruction per row, no registers or shared memory held).  row_ptrs [R]
    must be 16-byte aligned and nbytes a multiple of 16; rows where `ok` is false are skipped.
    Triton has no prefetch primitive, hence the inline PTX."""
    sizes = tl.full(row_ptrs.shape, nbytes, tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.b32 $0, 0; }",
        "=r,l,r,r", [row_ptrs, ok.to(tl.int32), sizes], dtype=tl.int32, is_pure=False, pack=1)
