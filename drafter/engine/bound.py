"""Propose from a trusted in-process caller's persistent buffers, described once.

    bound = engine.bind(target_token_ids=ids_buf, target_positions=pos_buf, ...)   # full-size buffers
    ...                                    # every step: the caller fills the buffers' first rows
    drafts = bound.propose(num_tokens, batch_size)   # [max_batch, k] int64; rows [:batch_size] are this step's

A target engine that replays its own CUDA graphs keeps its inputs in persistent buffers (vLLM's
runner does) and hands the proposer slices of them each step.  `engine.propose` then reads the
address, dtype and layout of ~12 tensors on every call and allocates an output: a few
microseconds on a quiet host, but each torch call costs 5-15x more right after the host waited
for the GPU (bench/results/2026-11-24-h100-host-probe: a one-element view 7-16 us there, ~1 us
in a loop), and that is where a decode step calls the drafter.  Bound, the buffers are described
once; a call writes two sizes into the header the captured loader reads, replays the graphs and
returns the bound output buffer: no torch or CUDA call but the replay (the previous call's
graphs mark the header read in the header itself, drafter.kernels.batch_inputs).

A remote caller's buffers are not trusted: the service binds the engine to a step guard's
outputs (drafter.engine.step_guard) and folds the guard in (fold): on a GPU each captured decode
graph of the binding then starts with the guard's launches, which take the sizes from the same
header words, so a guarded step is still one header store and ONE replay (unfolded, the guard
cost a fill of its own sizes word and a replay of its own graph: two more CUDA calls, 42-45 us
of host time a step on two H200s).  The graphs are the binding's own (the guard's launches name
its buffers), captured at fold for the engine's combined decode sizes; other sizes replay the
guard's own graph (sizes from the header too) before the engine's.

Without a guard, trusted like propose(validate=False): the structure of the buffers is checked at bind time
(dtypes, layouts, devices, capacities, InvalidInput naming the field) and the sizes of each call
are checked, but the values the caller writes are not; a malformed step reads or writes the KV
pool out of range.  Greedy chain or tree drafting at the captured sizes only: a call the graphs
do not cover runs eagerly on slices of the buffers (correct, not fast).
"""

from __future__ import annotations

import torch

from drafter.engine.graphs import readable_in_place
from drafter.engine.inputs import FLOAT_DTYPES, INT_DTYPES
from drafter.wire.records import ProposeInputs
from drafter.wire.errors import InvalidInput


class BoundPropose:
    def __init__(self, engine, inputs: ProposeInputs, drafts: torch.Tensor):  # drafts: [max_batch, width] int64
        runner = engine.graphs
        if runner is None:
            raise InvalidInput("engine", "binding buffers needs CUDA graphs (the Triton backend on a GPU)")
        if inputs.temperatures is not None:
            raise InvalidInput("temperatures", "bound calls draft greedily (the graphs' sampling)")
        self.engine, self.runner = engine, runner
        self.inputs = _checked(inputs, drafts, engine, runner)
        self.drafts = drafts
        self.max_tokens = min(t.shape[0] for t in (inputs.target_token_ids, inputs.target_positions,
                                                   inputs.target_hidden_states, *inputs.slot_mappings))
        self.max_batch = min(t.shape[0] for t in (
            inputs.next_token_ids, inputs.seq_lens, drafts, *inputs.block_tables,
            *(t for t in (inputs.token_indices_to_sample, inputs.num_rejected_tokens) if t is not None)))
        self.max_batch = min(self.max_batch, inputs.query_start_loc.shape[0] - 1)
        if not runner.captured:
            runner.capture()  # before any header is written: capture zeroes it
        # every word but the two sizes, written whole when another call (engine.propose shares the
        # header) wrote the header last; otherwise a call rewrites just the sizes
        self._words = runner.header.describe(self.inputs, drafts, converted=None)
        self._keep = (self.inputs, drafts, [])
        self._plans: dict[tuple, tuple[int, int, bool]] = {}  # checked sizes (and agreed ones) -> padded sizes, graphs?
        self.guard = None  # fold(): the step guard run ahead of every call
        self._folded: dict[tuple[int, int], object] = {}  # (tokens, batch) padded -> the guard + combined graph
        self._guard_alone = None  # the guard's graph reading the header's sizes (sizes without a folded graph)

    def fold(self, guard) -> None:
        """Run `guard` (a drafter.engine.step_guard.StepGuard whose outputs this binding reads) at the
        start of every call: captured into a graph per combined decode size with the engine's (one
        replay a step) and alone, reading the sizes each call stores in the header (emulated on
        CPU: run eagerly first, the same data flow).  Call it once, right after bind, holding the
        engine (no other call runs meanwhile)."""
        if self.guard is not None:
            raise RuntimeError("this binding already has its guard")
        header = self.runner.header.device  # [header words] int64: words N, B are the call's sizes
        with self.engine.on_device():  # captured on the engine's GPU, whichever is current (as bind's capture)
            self._folded, self._guard_alone = self.runner.capture_folded(lambda: guard.launch(header))
        self.guard = guard

    def propose(self, num_tokens: int, batch_size: int, batch_padded: int | None = None,
                tokens_padded: int | None = None) -> torch.Tensor:
        """Draft for the call held in the buffers' first num_tokens token rows and batch_size
        request rows; returns the bound drafts buffer, whose first batch_size rows the GPU fills
        (stream-ordered, like engine.propose's output).  Both are the caller's to keep in step
        with the GPU: write the buffers for the next call only after this call's graphs have
        read them (work queued later on the same stream is), and read the drafts before the next
        bound call overwrites them."""
        key = (num_tokens, batch_size, batch_padded, tokens_padded)
        plan = self._plans.get(key) or self._remembered_plan(key)
        b_pad, t_pad, graphs = plan
        if not graphs:
            if self.guard is not None:
                self.guard.step(num_tokens, batch_size)
            return self._eager(num_tokens, batch_size, b_pad, t_pad)
        runner = self.runner
        header = runner.header
        if header.owner is self:
            header.store_sizes(num_tokens, batch_size)
        else:
            words = self._words.copy()
            words[0], words[1] = num_tokens, batch_size
            header.store(words, self._keep, owner=self)
        folded = self._folded.get((t_pad, b_pad))
        if folded is not None:
            runner.replay_folded(folded)
            return self.drafts
        if self._guard_alone is not None:
            self._guard_alone()
        runner.replay(t_pad, b_pad)
        return self.drafts

    def armed_graph(self, num_tokens: int, batch_size: int, batch_padded: int = 0, tokens_padded: int = 0):
        """The replay an armed step of these sizes queues (replay_armed): the folded graph, or the
        guard's own graph and the first-pass and loop graphs (all read the header's sizes); the
        sizes checked as propose checks them (InvalidInput naming the field); None where no graphs
        cover them (the step runs through propose once its inputs are known to be there)."""
        key = (num_tokens, batch_size, batch_padded or None, tokens_padded or None)
        b_pad, t_pad, graphs = self._plans.get(key) or self._remembered_plan(key)
        if not graphs:
            return None
        folded, runner, alone = self._folded.get((t_pad, b_pad)), self.runner, self._guard_alone
        if folded is not None:
            return lambda: runner.replay_folded(folded)
        return lambda: (alone is not None and alone(), runner.replay(t_pad, b_pad))

    def replay_armed(self, replay, record: torch.Tensor,  # record: [ARM_WORDS] int64, the target's arm row
                     step: int, key: tuple[int, int, int, int]) -> None:
        """Queue an armed step (drafter.kernels.arm) behind whatever the caller queued first (the
        wait for the target's go word): the header's sizes from the target's record where it is
        (step, key), else 0 and 0 (the graphs then do nothing), then `replay` (armed_graph(*key)).
        Nothing is read on the host: the header's other words are this binding's (stored here
        where another call wrote them last)."""
        from drafter.kernels.arm import arm

        header = self.runner.header
        if header.owner is not self:
            words = self._words.copy()
            words[0] = words[1] = 0
            header.store(words, self._keep, owner=self)
        arm(record, header.device, step, key)
        replay()

    def check(self, num_tokens: int, batch_size: int, batch_padded: int | None = None,
              tokens_padded: int | None = None) -> None:
        """The call's sizes checked as propose checks them (InvalidInput naming the field), nothing
        run: a step served inside an engine call fused with other bindings' steps
        (drafter.service.batching.bound_steps) is refused exactly as its own call would be."""
        key = (num_tokens, batch_size, batch_padded, tokens_padded)
        if key not in self._plans:
            self._remembered_plan(key)

    def rows(self, num_tokens: int, batch_size: int) -> ProposeInputs:
        """The call held in the buffers' first num_tokens token rows and batch_size request rows
        (views of the bound buffers, no copy)."""
        inp, n, b = self.inputs, num_tokens, batch_size
        return ProposeInputs(
            inp.target_token_ids[:n], inp.target_positions[:n], inp.target_hidden_states[:n], inp.next_token_ids[:b],
            inp.query_start_loc[:b + 1], inp.seq_lens[:b], [t[:b] for t in inp.block_tables],
            [t[:n] for t in inp.slot_mappings], _rows(inp.token_indices_to_sample, b),
            _rows(inp.num_rejected_tokens, b))

    def _plan(self, num_tokens: int, batch_size: int, batch_padded, tokens_padded) -> tuple[int, int, bool]:
        """The call's padded sizes, checked, and whether graphs cover them."""
        b_pad, t_pad = self._sizes(num_tokens, batch_size, batch_padded, tokens_padded)
        return b_pad, t_pad, b_pad in self.runner.loop_graphs and t_pad in self.runner.first_graphs

    def _remembered_plan(self, key: tuple) -> tuple[int, int, bool]:
        """_plan of a call's (num_tokens, batch_size, batch_padded, tokens_padded), kept for the next
        call of the same four (their checks depend on nothing else: a remote step's agreed sizes
        are checked as before, once per distinct four; a refused call raises and is not kept), a
        bounded number."""
        plan = self._plan(*key)
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def _sizes(self, num_tokens: int, batch_size: int, batch_padded, tokens_padded) -> tuple[int, int]:
        if not 0 < batch_size <= self.max_batch:
            raise InvalidInput("batch_size", f"{batch_size} must lie in [1, {self.max_batch}] (the bound buffers)")
        if not batch_size <= num_tokens <= self.max_tokens:
            raise InvalidInput("num_tokens", f"{num_tokens} must lie in [batch_size={batch_size}, {self.max_tokens}]")
        limits = self.engine.limits
        if batch_size > limits.max_num_seqs:
            raise InvalidInput("batch_size", f"{batch_size} exceeds max_num_seqs {limits.max_num_seqs}")
        if num_tokens > limits.max_num_batched_tokens:
            raise InvalidInput("num_tokens", f"{num_tokens} exceeds max_num_batched_tokens "
                                             f"{limits.max_num_batched_tokens}")
        return self.engine.padded_sizes(batch_size, num_tokens, batch_padded, tokens_padded)

    def _eager(self, n: int, b: int, b_pad: int, t_pad: int) -> torch.Tensor:
        out = self.engine._propose_eager(self.rows(n, b), False, False, b_pad, t_pad)
        self.drafts[:b].copy_(out.draft_token_ids)
        return self.drafts


_MAX_PLANS = 4096  # distinct sizes remembered: decode steps use a handful


def _rows(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if t is None else t[:n]


def _checked(inp: ProposeInputs, drafts: torch.Tensor, engine, runner) -> ProposeInputs:
    """The buffers' structure (not their values): dtypes, dimensions, one device the loader reads
    in place; InvalidInput naming the first bad field."""
    for name, t in _tensors(inp):
        if name != "target_hidden_states" and not name.startswith("block_tables") and (
                not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in INT_DTYPES or not t.is_contiguous()):
            raise InvalidInput(name, "expected a contiguous 1-D int32 / int64 tensor (read in place)")
    for g, table in enumerate(inp.block_tables):
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.dtype not in INT_DTYPES \
                or table.stride(1) != 1:
            raise InvalidInput(f"block_tables[{g}]", "expected a 2-D int32 / int64 tensor with contiguous rows")
        if table.shape[1] < engine.config.max_blocks_per_req[g]:
            raise InvalidInput(f"block_tables[{g}]", f"{table.shape[1]} columns, the engine's requests need up to "
                                                     f"{engine.config.max_blocks_per_req[g]}")
    hidden = inp.target_hidden_states
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[1] != engine.spec.hidden_input_width \
            or hidden.stride(1) != 1 or hidden.dtype not in FLOAT_DTYPES:
        raise InvalidInput("target_hidden_states", f"expected [tokens, {engine.spec.hidden_input_width}] "
                                                   "bfloat16 / float16 / float32 with contiguous rows")
    if drafts.dtype != torch.int64 or drafts.dim() != 2 or drafts.shape[1] != runner.width \
            or not drafts.is_contiguous():
        raise InvalidInput("drafts", f"expected a contiguous [max_batch, {runner.width}] int64 tensor")
    if inp.query_start_loc.shape[0] < 2:
        raise InvalidInput("query_start_loc", "needs room for batch + 1 entries")
    for name, t in _tensors(inp):
        if not readable_in_place(t, runner.device):
            raise InvalidInput(name, f"a bound buffer must live on {runner.device} (or in pinned host memory, "
                                     f"contiguous), got {t.device}")
    if drafts.device != runner.device:
        raise InvalidInput("drafts", f"must live on {runner.device}, got {drafts.device}")
    return inp


def _tensors(inp: ProposeInputs):
    """(field name, tensor) of every buffer given, block tables and slot mappings per group."""
    for name in ("target_token_ids", "target_positions", "target_hidden_states", "next_token_ids",
                 "query_start_loc", "seq_lens", "token_indices_to_sample", "num_rejected_tokens"):
        if getattr(inp, name) is not None:
            yield name, getattr(inp, name)
    for g, t in enumerate(inp.block_tables):
        yield f"block_tables[{g}]", t
    for g, t in enumerate(inp.slot_mappings):
        yield f"slot_mappings[{g}]", t
