"""Programmatic dependent launch (PDL): each draft-step kernel starts while the one before it drains.

A greedy draft step is a chain of about nine launches (qkv GEMM, rotary + KV write, attention,
o GEMM, gate/up GEMM, down GEMM, lm_head, argmax + next inputs), most of which stream their
weights once.  Between two of them the GPU finishes the first kernel's last programs and only
then starts the next one's: a few microseconds per boundary in which the memory system is
half idle, about a tenth of a step at batch <= 64 (DESIGN section 9's floor).  On Hopper
(sm_90 and later) a kernel launched with the programmatic-stream-serialization attribute may
be scheduled once every program of the kernel before it has executed
`griddepcontrol.launch_dependents`; its programs then fill the SMs the earlier kernel frees,
start streaming their weights into L2, and block in `griddepcontrol.wait` until that kernel
(and, through it, everything before) has completed and its writes are visible.  CUDA graph
capture keeps these as programmatic edges.

Every kernel launched with `pdl=True` keeps three rules:
  1. `chain_signal` first: its dependents may then be placed as its own programs finish;
  2. before `chain_wait`, read only memory that no kernel writes (weights), and write nothing:
     the kernels before it may still be running, and the ones before those too;
  3. `chain_wait` in every program, unconditionally, before any other memory access: a program
     that returned early would let this kernel complete before its predecessor did, and the
     kernel after it relies on "this one completed" meaning "all before it completed".
A kernel launched without the attribute simply waits for everything before it, as usual, so
the chain may mix both (cuBLAS, torch ops).

Under the Triton interpreter, on the CPU and before Hopper `enabled` is False and the kernels
compile without the instructions.  DRAFTER_PDL=0 turns it off (for A/B timing).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # triton >= 3.3; older builds run every kernel as an ordinary launch
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the installed triton
    gdc_launch_dependents = gdc_wait = None

L2_LINE_BYTES = 128


@functools.cache
def _capable(index: int) -> bool:
    return gdc_wait is not None and torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched as a programmatic chain."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("DRAFTER_PDL") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(pdl: bool) -> dict:
    """The launch keywords of a kernel call with PDL=pdl."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def chain_signal(PDL: tl.constexpr):
    """Let the next kernel in the stream be scheduled (rule 1)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def chain_wait(PDL: tl.constexpr):
    """Block until the kernels before this one have completed and their writes are visible (rule 3)."""
    if PDL:
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 to fetch the 128-byte lines holding ptrs (any shape of pointers); nothing is read
    into registers, so it may run before chain_wait on memory no kernel writes."""
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def chain_start(PDL: tl.constexpr):
    """Rules 1 and 3 at a kernel's first line, for kernels with nothing to fetch before the wait."""
    chain_signal(PDL)
    chain_wait(PDL)
