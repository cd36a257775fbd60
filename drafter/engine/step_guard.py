"""A bound step checked and masked on the device, without a host pass: the cuda_ipc plane's guard.

    guard = StepGuard(src, limits, error)     # src: the target's buffers (views of its shared slab)
    bound = engine.bind(...guard.out..., target_hidden_states=src[HIDDEN])
    bound.fold(guard)                         # on a GPU: the guard captured into the bound graphs
    bound.propose(num_tokens, batch)          # per step: the header's sizes stored, ONE replay

    guard.step(num_tokens, batch)             # alone (tests, the bench): its own sizes, its own graph
                                              # where capture() made one

The engine is bound to guard.out (the small buffers, the drafter's own) and to the target's hidden
states in place.  Each step the guard copies every small buffer from the target's slab into its
own, masking whatever lies outside the session's limits, and moves block ids and slots into the
session's range of the engine's pool:

  * token ids and next token ids outside [0, vocab), positions outside [0, max_model_len) -> 0;
  * seq_lens outside [1, max_model_len] -> 1, token_indices_to_sample outside [0, num_tokens) and
    num_rejected_tokens outside [0, k] -> 0;
  * block ids outside [0, the session's blocks) -> the session's first block; slots outside
    [-1, blocks * block size) -> the padding slot (-1), as are the slots of every token whose
    hidden state is not finite;
  * a query_start_loc that is not 0 first, num_tokens at the batch, strictly increasing between
    -> one token per request (the last takes the rest);
  * rows past the step's sizes -> the neutral values (slot -1, block the session's first, 0).

So every KV write of the step lands in the session's own blocks (or nowhere), whatever the target
wrote.  The fields found out of range set bits of one int64 error word (drafter.wire.bound.
guard_fields order), written to `error`, which the target reads back with the drafts and turns
into INVALID_ARGUMENT naming the first.  Every op has a static shape and the sizes come from a
device tensor (`sizes`: [num_tokens, batch]), so the same code runs eagerly on CPU tensors (the
tests) and captured on a GPU.

Where the sizes come from.  Alone, step() writes them into `sizes` (host stores on CPU, two
fills on a GPU) before its replay.  Folded (launch(header), drafter.engine.bound.BoundPropose.fold),
the guard reads them from words N and B of the engine's input header, the pinned words the bound
call already fills with plain host stores: the Triton kernels load them in place (mapped host
memory, as the engine's loader does; the read overlaps each kernel's loads of its buffer), the
torch reference has them copied into `sizes` first (a one-program kernel on a GPU, a copy on CPU).
Captured with the engine's graphs, a step then costs the host no torch op and no CUDA call for
the guard at all (on two H200s the guard alone was 42-45 us of the drafter's ~85 us from step
start to GPU work queued: the sizes' fill and a second replay).

Two implementations of the same rules: run_reference, ~150 torch ops (each a kernel of a few
microseconds in the captured graph: a few hundred microseconds a step on an H100), and
drafter.kernels.step_guard, one Triton launch per buffer (the default on a GPU; `fused`
chooses; the tests compare both, the fused one under the Triton interpreter on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter.wire.bound import HIDDEN, guard_fields

PADDING_SLOT = -1


@dataclass(frozen=True)
class GuardLimits:
    """What one session may name: its vocabulary, length, KV range per group and draft length."""

    vocab_size: int
    max_model_len: int
    num_speculative_tokens: int
    num_blocks: tuple[int, ...]  # per KV group: the session's blocks
    block_sizes: tuple[int, ...]
    bases: tuple[int, ...]  # per KV group: the session's first block in the engine's pool

    @property
    def groups(self) -> int:
        return len(self.num_blocks)


class StepGuard:
    def __init__(self, src: dict[str, torch.Tensor], limits: GuardLimits, error: torch.Tensor,
                 fused: bool | None = None):
        """src: the target's buffers by field name (1-D int, block_tables[g] 2-D int, the hidden
        states [tokens, width] float), all on one device; error: [1] int64 on that device;
        fused: the Triton kernels (default: on a GPU, where every buffer is contiguous)."""
        self.src, self.limits, self.error = src, limits, error
        self.device = src[HIDDEN].device
        self.fields = guard_fields(limits.groups)
        self.out = {name: torch.zeros_like(t) for name, t in src.items() if name != HIDDEN}
        self.sizes = torch.zeros(2, dtype=torch.int64, device=self.device)  # [2]: num_tokens, batch
        self._sizes_host = self.sizes.numpy() if self.device.type == "cpu" else None  # host stores on CPU
        self._size_words = (self.sizes[0:1], self.sizes[1:2])  # [1] each: step()'s fills on a GPU
        self._rows: dict[int, torch.Tensor] = {}
        self.graph = None
        contiguous = all(t.is_contiguous() for t in src.values())
        self.fused = (self.device.type == "cuda" and contiguous) if fused is None else (fused and contiguous)
        self._nonfinite = torch.zeros(src[HIDDEN].shape[0], dtype=torch.int8, device=self.device)  # [rows]

    # ------------------------------------------------------------------ per step
    def step(self, num_tokens: int, batch: int) -> None:
        """The guard alone: check and mask the step the target's buffers hold (sizes already
        checked on the host), its sizes written here."""
        if self._sizes_host is not None:
            self._sizes_host[0], self._sizes_host[1] = num_tokens, batch
        else:  # two fills, stream-ordered (a replay still queued keeps its sizes); with a pageable copy here
            # the guard alone took 32-34 us of GPU time, 21-23 with one fill (2x H200, 2026-11-26)
            self._size_words[0].fill_(num_tokens)
            self._size_words[1].fill_(batch)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()

    def launch(self, header: torch.Tensor) -> None:  # header: [>= 2] int64, words 0, 1: num_tokens, batch
        """The guard with its sizes read from `header` (the engine's input header: pinned host
        memory on a GPU): what BoundPropose.fold captures at the start of the bound graphs (and
        runs eagerly where the graphs are emulated).  No host read, no torch op on the fused path."""
        if self.fused:
            self._run_fused(header)
            return
        if self.device.type == "cuda":
            from drafter.kernels.step_guard import copy_sizes_kernel

            copy_sizes_kernel[(1,)](header, self.sizes)
        else:
            self.sizes.copy_(header[:2])
        self.run_reference()

    def capture(self) -> None:
        """On a GPU: capture run() once (warmed up on a side stream first)."""
        if self.device.type != "cuda":
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call during the capture (a client's staging) is not an error
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.run()
        self.graph = graph

    # ------------------------------------------------------------------ the checks
    def run(self) -> None:
        """The whole guard, no host read: the Triton kernels or the torch reference."""
        if self.fused:
            self._run_fused(self.sizes)
        else:
            self.run_reference()

    def _ranges(self):
        """(name, by batch, low, high, masked, padding, high is num_tokens) of each 1-D range check."""
        lim = self.limits
        yield "target_token_ids", False, 0, lim.vocab_size, 0, 0, False
        yield "target_positions", False, 0, lim.max_model_len, 0, 0, False
        yield "next_token_ids", True, 0, lim.vocab_size, 0, 0, False
        yield "seq_lens", True, 1, lim.max_model_len + 1, 1, 0, False
        if "token_indices_to_sample" in self.src:
            yield "token_indices_to_sample", True, 0, 0, 0, 0, True
        if "num_rejected_tokens" in self.src:
            yield "num_rejected_tokens", True, 0, lim.num_speculative_tokens + 1, 0, 0, False

    def _run_fused(self, sizes: torch.Tensor) -> None:  # sizes: [>= 2] int64: num_tokens, batch
        """drafter.kernels.step_guard: the error word zeroed, then one launch per buffer."""
        import triton

        from drafter.kernels import step_guard as k

        src, out, lim, err = self.src, self.out, self.limits, self.error
        bit = {name: 1 << i for i, name in enumerate(self.fields)}
        err.zero_()
        hidden = src[HIDDEN]  # [rows, width]
        k.finite_kernel[(hidden.shape[0],)](hidden, hidden.stride(0), hidden.shape[1], self._nonfinite, sizes, err,
                                            bit[HIDDEN], BLOCK=min(1024, triton.next_power_of_2(hidden.shape[1])))
        for name, by_batch, low, high, masked, padding, high_is_n in self._ranges():
            t = src[name]  # [capacity]
            k.range_kernel[(triton.cdiv(t.numel(), k.BLOCK),)](
                t, out[name], t.numel(), sizes, err, bit[name], low, high, masked, padding,
                BY_BATCH=by_batch, HIGH_IS_TOKENS=high_is_n, BLOCK=k.BLOCK)
        qsl = src["query_start_loc"]  # [capacity + 1]
        k.query_start_kernel[(1,)](qsl, out["query_start_loc"], qsl.numel(), sizes, err, bit["query_start_loc"],
                                   BLOCK=triton.next_power_of_2(qsl.numel()))
        for g in range(lim.groups):
            name = f"block_tables[{g}]"
            t = src[name]  # [capacity, columns]
            k.table_kernel[(triton.cdiv(t.numel(), k.BLOCK),)](
                t, out[name], t.numel(), t.shape[1], sizes, err, bit[name], lim.num_blocks[g], lim.bases[g],
                BLOCK=k.BLOCK)
        for g in range(lim.groups):
            name = f"slot_mappings[{g}]"
            t = src[name]  # [capacity]
            k.slots_kernel[(triton.cdiv(t.numel(), k.BLOCK),)](
                t, out[name], t.numel(), self._nonfinite, self._nonfinite.numel(), sizes, err, bit[name],
                lim.num_blocks[g] * lim.block_sizes[g], lim.bases[g] * lim.block_sizes[g], BLOCK=k.BLOCK)

    def run_reference(self) -> None:
        """The whole guard in static-shape torch ops (no host read)."""
        n, b = self.sizes[0], self.sizes[1]
        lim, src, out = self.limits, self.src, self.out
        bad: dict[str, torch.Tensor] = {}

        bad["target_token_ids"] = self._range("target_token_ids", n, 0, lim.vocab_size, 0, 0)
        bad["target_positions"] = self._range("target_positions", n, 0, lim.max_model_len, 0, 0)
        hidden = src[HIDDEN]  # [tokens, width]
        nonfinite = ~torch.isfinite(hidden).all(dim=1) & (self._idx(hidden.shape[0]) < n)  # [tokens]
        bad[HIDDEN] = nonfinite.any()
        bad["next_token_ids"] = self._range("next_token_ids", b, 0, lim.vocab_size, 0, 0)
        bad["query_start_loc"] = self._query_start_loc(n, b)
        bad["seq_lens"] = self._range("seq_lens", b, 1, lim.max_model_len + 1, 1, 0)
        for g in range(lim.groups):
            bad[f"block_tables[{g}]"] = self._table(g, b)
        for g in range(lim.groups):
            bad[f"slot_mappings[{g}]"] = self._slots(g, n, nonfinite)
        zero = torch.zeros((), dtype=torch.bool, device=self.device)
        bad["token_indices_to_sample"] = self._range("token_indices_to_sample", b, 0, n, 0, 0) \
            if "token_indices_to_sample" in src else zero
        bad["num_rejected_tokens"] = self._range("num_rejected_tokens", b, 0, lim.num_speculative_tokens + 1, 0, 0) \
            if "num_rejected_tokens" in src else zero
        flags = torch.stack([bad[f] for f in self.fields]).to(torch.int64)  # [fields]
        bits = torch.bitwise_left_shift(torch.ones_like(flags), self._idx(len(self.fields)))  # [fields]
        self.error.copy_((flags * bits).sum().reshape(1))

    def _idx(self, length: int) -> torch.Tensor:  # [length] int64: 0 .. length - 1
        rows = self._rows.get(length)
        if rows is None:
            rows = self._rows[length] = torch.arange(length, dtype=torch.int64, device=self.device)
        return rows

    def _range(self, name: str, size, low, high, masked: int, padding: int) -> torch.Tensor:
        """Rows [:size] of a 1-D buffer checked against [low, high): bad ones -> masked, rows past
        size -> padding; whether any row was bad."""
        t = self.src[name]  # [capacity]
        live = self._idx(t.shape[0]) < size
        wrong = live & ((t < low) | (t >= high))
        self.out[name].copy_(torch.where(wrong, masked, torch.where(live, t, padding)))
        return wrong.any()

    def _query_start_loc(self, n, b) -> torch.Tensor:
        t = self.src["query_start_loc"]  # [capacity + 1]
        idx = self._idx(t.shape[0])
        step = t[1:] - t[:-1]
        wrong = (t[0] != 0) | ((idx == b) & (t != n)).any() | ((idx[1:] <= b) & (step < 1)).any()
        fixed = torch.where(idx < b, idx, n).to(t.dtype)  # one token a request, the last takes the rest
        self.out["query_start_loc"].copy_(torch.where(wrong, fixed, torch.where(idx <= b, t, n)))
        return wrong

    def _table(self, g: int, b) -> torch.Tensor:
        name = f"block_tables[{g}]"
        t = self.src[name]  # [capacity, columns]
        live = (self._idx(t.shape[0]) < b)[:, None]
        wrong = live & ((t < 0) | (t >= self.limits.num_blocks[g]))
        self.out[name].copy_(torch.where(live & ~wrong, t, 0) + self.limits.bases[g])
        return wrong.any()

    def _slots(self, g: int, n, nonfinite: torch.Tensor) -> torch.Tensor:  # nonfinite: [hidden rows] bool
        name = f"slot_mappings[{g}]"
        t = self.src[name]  # [capacity]
        live = self._idx(t.shape[0]) < n
        wrong = live & ((t < PADDING_SLOT) | (t >= self.limits.num_blocks[g] * self.limits.block_sizes[g]))
        keep = live & ~wrong & (t >= 0)
        rows = min(t.shape[0], nonfinite.shape[0])
        if rows:
            keep[:rows] &= ~nonfinite[:rows]
        shift = self.limits.bases[g] * self.limits.block_sizes[g]
        self.out[name].copy_(torch.where(keep, t + shift, PADDING_SLOT))
        return wrong.any()
