"""Reading the next weight matrix into L2 while the step's small kernels run.

Between two weight GEMMs of a draft step sit latency-bound kernels (rotary + KV write and
attention between the q/k/v and o projections; argmax and the embedding between one step's
lm_head and the next step's q/k/v).  For those microseconds the DRAM is idle.  A prefetch
kernel on a side stream reads the next GEMM's weights (or their first rows, up to a budget
that fits in L2) in that window, so the GEMM finds them in L2.  Every byte still comes from
DRAM once per step: the floor is unchanged, the idle window is spent.

The side stream forks from the main stream after the GEMM that precedes the window (so it
never competes with a GEMM for bandwidth) and joins at the end of the captured region: no GEMM
waits for a prefetch.  Correctness never depends on it: it only reads weights, which nothing
writes while drafting.

The kernel XORs the words it read into a sink word: a load whose value is never used may be
dropped by the compiler, and the checksum lets a test see that every byte was read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_words"])
def l2_prefetch_kernel(
    src_ptr,  # [n_words] int32: the weight bytes
    sink_ptr,  # [1] int32: XOR of every word read
    n_words,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, n_words, step):
        idx = start + offs
        acc ^= tl.load(src_ptr + idx, mask=idx < n_words, other=0)
    tl.atomic_xor(sink_ptr, tl.xor_sum(acc, 0))


def prefetch_words(weight: torch.Tensor, max_bytes: int) -> torch.Tensor:
    """The first min(max_bytes, all) bytes of a contiguous weight, as int32 words."""
    if not weight.is_contiguous():
        raise ValueError("prefetch needs a contiguous weight")
    flat = weight.view(-1).view(torch.uint8)
    n = min(flat.numel(), max_bytes) // 4 * 4
    return flat[:n].view(torch.int32)


def launch_prefetch(words: torch.Tensor, sink: torch.Tensor, programs: int, block: int = 4096) -> None:
    """words [n] int32, sink [1] int32 (XOR-accumulated)."""
    if words.numel():
        l2_prefetch_kernel[(programs,)](words, sink, words.numel(), BLOCK=block, num_warps=4)


class WeightPrefetcher:
    """Issues prefetches on one side stream of the engine's device; `join` makes the current
    stream wait for them (call it before the end of a graph capture or of a propose)."""

    def __init__(self, device: torch.device, max_bytes: int | None = None, programs: int | None = None):
        props = torch.cuda.get_device_properties(device)
        # half of L2: the GEMM's own traffic and the KV reads still need room
        self.max_bytes = max_bytes if max_bytes is not None else props.L2_cache_size // 2 if hasattr(
            props, "L2_cache_size") else 24 << 20
        self.programs = programs or props.multi_processor_count
        self.stream = torch.cuda.Stream(device)
        self.sink = torch.zeros(1, dtype=torch.int32, device=device)
        self.pending = False

    def prefetch(self, weight: torch.Tensor, max_bytes: int | None = None) -> None:
        """Start reading weight's first bytes into L2 once the work queued so far is done."""
        words = prefetch_words(weight, self.max_bytes if max_bytes is None else min(max_bytes, self.max_bytes))
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            launch_prefetch(words, self.sink, self.programs)
        self.pending = True

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.pending = False
