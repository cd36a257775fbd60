"""The two-rank process group of a bound session's channel planes, for both ends.

    group = open_group(backend, store, prefix, rank, timeout)   # gloo (CPU tensors) or nccl (GPU tensors)
    handshake(group, rank, device, deadline)                   # nccl_channel: both directions connected
    settle(work, deadline, what)                               # a send or recv done, or TimeoutError
    close_group(group)                                         # aborted: nothing of it left pending

The drafter hosts the TCPStore (drafter.wire.bound.BindResponse.store) and is rank 1; the target
is rank 0.  "gloo_channel" is gloo on host tensors; "nccl_channel" is NCCL between two GPUs.  NCCL
builds a communicator at a group's first operation, and both ranks block in it until both joined,
and NCCL connects each direction between two ranks at its first operation there, blocking inside
that call until the peer makes the matching one.  So the nccl_channel's two ends exchange one word
each way right after they joined (handshake) rather than inside the first step, where neither set-up
can complete: the target's first send would wait for a drafter that posts its recv only once it has
the header the target sends after that send, and the drafter's first output send would wait for a
recv the target posts only after the StepDone that follows that send.

Bounded waits: settle() polls a work's completion against a deadline (a work's wait() on NCCL
only orders the current stream; on gloo it blocks up to the group's timeout).  A NCCL group is
made with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 unless the environment says otherwise, so an operation
past the group's timeout aborts this channel's communicator and leaves the process running (the
default would end the process: a drafter serves other sessions).  Neutral: torch only.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

GLOO, NCCL = "gloo", "nccl"
DRAFTER_RANK, TARGET_RANK = 1, 0
HANDSHAKE_WORD = 0x5EED  # what the target's handshake sends; the drafter checks it


def nccl_available() -> bool:
    """Whether this process can build a NCCL channel (torch with NCCL, a GPU)."""
    return torch.cuda.is_available() and dist.is_nccl_available()


def open_group(backend: str, store, prefix: str, rank: int, timeout: datetime.timedelta):
    """This end (rank) of the binding's two-rank group on `store` under `prefix`.  Gloo joins
    here (blocking up to timeout); NCCL joins at its first operation (handshake)."""
    prefixed = dist.PrefixStore(prefix, store)
    if backend == GLOO:
        return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
    if backend != NCCL:
        raise ValueError(f"channel backend {backend!r}: {GLOO} or {NCCL}")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # abort the communicator, not the process
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, 2, options)


def handshake(group, rank: int, device: torch.device, deadline: float, inputs: torch.Tensor | None = None,
              output: torch.Tensor | None = None) -> None:
    """One word each way, target to drafter, then drafter to target.  NCCL builds the communicator
    at the first operation and connects each direction at its first operation between the two
    ranks, blocking inside that call until the peer makes the matching one; doing both here, while
    both ends wait for each other anyway, keeps every step's sends and recvs free of that set-up (a
    drafter whose first output send had to wait for the target's recv, which the target posts only
    after the StepDone that send precedes, would block for good).  RuntimeError where a transfer
    failed or carried another word, TimeoutError past deadline (time.monotonic).  inputs ([ring
    bytes] uint8, the slab) and output ([output words] int64), given on both ends, then go once each
    way at their full sizes: the steps' own buffers and sizes, so no step's transfer is the first of
    its kind (their contents are the bind's zeros)."""
    on_gpu = torch.device(device).type == "cuda"
    words = {TARGET_RANK: HANDSHAKE_WORD, DRAFTER_RANK: HANDSHAKE_WORD + 1}  # what each rank sends
    for sender in (TARGET_RANK, DRAFTER_RANK):
        if rank == sender:
            word = torch.full((1,), words[sender], dtype=torch.int64, device=device)  # [1]
            work = group.send([word], 1 - rank, 0)
        else:
            word = torch.zeros(1, dtype=torch.int64, device=device)  # [1]
            work = group.recv([word], sender, 0)
        settle(work, deadline, "the channel's handshake", on_gpu)
        if on_gpu:
            work.wait()  # raises where it failed; orders the read below (a gloo work is waited for once only)
        if rank != sender and int(word.cpu()[0]) != words[sender]:
            raise RuntimeError(f"the channel's handshake carried {int(word.cpu()[0]):#x}")
    if inputs is None or output is None:
        return
    for sender, buffer in ((TARGET_RANK, inputs), (DRAFTER_RANK, output)):
        work = group.send([buffer], 1 - rank, 0) if rank == sender else group.recv([buffer], sender, 0)
        settle(work, deadline, "the channel's handshake", on_gpu)
        if on_gpu:
            work.wait()


def settle(work, deadline: float, what: str, on_gpu: bool = True) -> None:
    """Until `work` completed; TimeoutError past deadline (time.monotonic).  on_gpu (NCCL): poll the
    work's own completion, no host sync on a stream (then work.wait() raises where it failed); else
    (gloo, whose works complete only inside wait): wait for what is left of the deadline (a failure
    raises here)."""
    if not on_gpu:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what}: not done in time")
        try:
            work.wait(datetime.timedelta(seconds=left))
        except RuntimeError as exc:
            raise TimeoutError(f"{what}: {exc}") from None
        return
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done in time")
        os.sched_yield()  # another thread of this process (a ZMQ poll, the engine) may run
    # a failed work completes too: the caller's wait() raises its error (Work.exception() is not
    # usable: torch 2.11 cannot return it to Python for NCCL works)


def close_group(group) -> None:
    """Abort the group (any operation still pending on it ends); errors ignored: it is going away."""
    if group is None:
        return
    for name in ("abort", "shutdown"):
        fn = getattr(group, name, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception:  # noqa: BLE001 - torch's refusals vary by version; the group is going away anyway
            continue
