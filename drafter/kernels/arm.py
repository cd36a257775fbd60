"""An armed step's first kernel: the target's step record against the step queued ahead.

A drafter queues an armed binding's next step before its header has come (drafter.service.bound_ipc,
drafter.wire.bound.ARM_WORDS): a GPU wait for the target's go word, this kernel, then the binding's
folded graph for the sizes the step was queued for.  The graph takes its sizes from the engine's
input header (words N and B, drafter.kernels.batch_inputs); this kernel writes them there from the
target's record (copied by the target's stream before the go word) where the record is exactly the
step and sizes queued, and 0 and 0 otherwise: a graph told of no tokens and no requests reads and
writes nothing outside its own static buffers (the loader pads every row; the drafts store writes no
row), so a step queued for other sizes than the target's, or released without its record, does
nothing.  The host checked the queued sizes as for any bound step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drafter.kernels.batch_inputs import B, N
from drafter.wire.bound import ARM_STEP

_STEP = tl.constexpr(ARM_STEP)  # globals a kernel reads must be constexpr

@triton.jit(do_not_specialize=["step", "n", "b", "bp", "tp"])
def arm_kernel(rec_ptr, hdr_ptr, step, n, b, bp, tp):
    """rec_ptr: [ARM_WORDS] int64, the arm row; hdr_ptr: [header words] int64."""
    r = rec_ptr + _STEP
    ok = (tl.load(r, volatile=True) == step) & (tl.load(r + 1, volatile=True) == n) \
        & (tl.load(r + 2, volatile=True) == b) & (tl.load(r + 3, volatile=True) == bp) \
        & (tl.load(r + 4, volatile=True) == tp)
    tl.store(hdr_ptr + N, tl.where(ok, n, 0).to(tl.int64))
    tl.store(hdr_ptr + B, tl.where(ok, b, 0).to(tl.int64))


def arm(record: torch.Tensor,  # [ARM_WORDS] int64: the arm row (the target's record at ARM_STEP..)
        header: torch.Tensor,  # [header words] int64: the engine's input header, where its graphs read it
        step: int, key: tuple[int, int, int, int]) -> None:
    """Queue the check of the record against (step, key = num_tokens, batch, batch_padded,
    tokens_padded): the header's sizes become the key's, or 0 and 0."""
    if record.device.type == "cuda":
        arm_kernel[(1,)](record, header, step, *key)
        return
    ok = record[ARM_STEP:ARM_STEP + 5].tolist() == [step, *key]  # the CPU emulation: synchronous
    header[int(N)] = key[0] if ok else 0
    header[int(B)] = key[1] if ok else 0
