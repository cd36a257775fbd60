"""CUDA graphs for the draft engine: one first-pass graph per token capture size, one graph
of the whole draft loop (chain or tree) per batch capture size, and, for the sizes a decode
step uses, one graph of both.

    runner = GraphRunner(engine)      # engine: a DraftEngine on CUDA with the Triton backend
    runner.capture()                  # optional: done by the first run() otherwise
    ids = runner.run(inp, t_pad, b_pad)   # [batch, k | nodes] int64, a fresh tensor

The graphs read only the engine's StaticBuffers, a few static hand-off tensors and the call's
header (batch_inputs.InputHeader), so one replay serves any batch padded to its size:
  * the first pass over t tokens runs with attention metadata for min(t, largest batch) requests
    (a batch never has more requests than tokens); the requests past the call's batch have
    query length 0 and seq_len 0 and read nothing; that keys its graph by token count alone
    (a combined graph knows its batch: its first pass covers that many requests, so the
    attention kernel splits each real request's keys over more programs);
  * its sampled rows are copied into static tensors that the loop reads;
  * padded rows have slot -1 and seq_len 0 in the buffers: they write and read nothing;
  * the loop decides which rows are live from the buffers (seq_len > 0), never from a host int;
  * the loop's last kernel stores the real rows of the drafts into the output tensor the host
    allocated for the call (its address is in the header): no static drafts buffer, no clone.
A decode call of b' requests with q = width + 1 tokens each (the padded drafter batch: k + 1 for
a chain) pads to one (tokens, batch) pair; for each such pair a combined graph (first pass + loop)
makes the call one replay instead of two.  Other calls (a prefill, the unpadded path) replay the
two graphs.  Graphs are captured largest first into one shared memory pool: only one graph runs
at a time, so their intermediates may share memory; what must outlive a replay lives outside
the pool.

The graphs own every address they were captured with, whatever the process does around them
(tests/gpu/test_graph_neighbours.py).  The one address they would otherwise borrow is cuBLAS's
workspace: torch keeps one per (cuBLAS handle, stream), allocated on the pair's first GEMM, and
a captured GEMM keeps that workspace's address.  On torch.cuda.graph's shared default capture
stream the workspace was allocated by whichever capture came first (our GEMM planner's timing
graphs, another library's), in that graph's pool, which dies with it; inductor's CUDA graph
trees (torch.compile mode="reduce-overhead") free every workspace before they warm up or record,
and their recording's empty_cache then hands that dead pool's memory back to the driver: the
next replay here wrote to unmapped memory (an illegal memory access).  So the runner captures
on a stream created for it alone (private_stream), never used before and never used by anyone
else: the workspace of its graphs is allocated during its first capture, inside its own pool,
which lives as long as its graphs; freed by inductor, that memory stays in the pool, mapped and
unused by others.

A tensor-parallel head (its shard's world > 1) is captured the same way with its NCCL collectives
inside the graphs ("all ranks replay the same padded graph"): every rank builds the same runner
from the same config, so it captures the same graphs in the same order, and every call reaches all
ranks with the same inputs and padded sizes (drafter.service.tp broadcasts them), so all ranks
replay the same graph and its collectives pair up.  One eager collective runs before the first
capture (NCCL creates its communicator lazily, which a capture cannot do), and capture uses
torch's "thread_local" error mode: the process group's watchdog thread queries its events while
the capture runs, which the "global" mode would count as an error of this capture.

Greedy drafting only: a call with temperatures, or asking for probabilities or logits, runs
eagerly, as does a call above the largest size captured.

`emulate=True` (tests on CPU) "captures" a step by keeping the function and "replays" it by
calling it again: the same static-buffer data flow, checkable where no GPU exists.
"""

from __future__ import annotations

from typing import Callable

import torch

from drafter.kernels.batch_inputs import InputHeader, load_inputs
from drafter.kernels.draft_output import store_drafts
from drafter.attention.metadata import PADDING_SLOT_ID
from drafter.engine.config import pad_to_capture_size
from drafter.kernels.cuda_timing import private_stream
from drafter.wire.records import ProposeInputs


class GraphRunner:
    def __init__(self, engine, max_batch: int | None = None, max_tokens: int | None = None, emulate: bool = False,
                 combined: bool | None = None):
        """max_batch / max_tokens: capture only sizes up to these (larger calls run eagerly).
        combined: also capture first pass + loop as one graph per decode-step size pair
        (default: the engine's config.combined_graphs)."""
        cfg = engine.config
        self.engine = engine
        self.emulate = emulate
        self.batch_sizes = [s for s in cfg.capture_sizes if max_batch is None or s <= max_batch]
        self.token_sizes = [s for s in cfg.token_capture_sizes if max_tokens is None or s <= max_tokens]
        # the first pass always runs with metadata for the buffers' full batch (see module doc)
        self.meta_batch = cfg.capture_sizes[-1]
        self.device = engine.buffers.input_ids.device
        dtype = cfg.torch_dtype
        h = engine.spec.hidden_size
        self.width = cfg.num_tree_nodes or cfg.num_speculative_tokens  # drafts per request
        # hand-off from the first pass to the loop, outside the graph pool
        self.first_logit_h = torch.zeros(self.meta_batch, h, dtype=dtype, device=self.device)  # [max_batch, hidden]
        self.first_carry_h = torch.zeros(self.meta_batch, h, dtype=dtype, device=self.device)  # [max_batch, hidden]
        self.first_pos = torch.zeros(self.meta_batch, dtype=torch.long, device=self.device)  # [max_batch]
        self._drafts_like = torch.empty(0, dtype=torch.int64, device=self.device)  # new_output's dtype and device
        # the call's sizes and tensor addresses, read by the loader and by the loop's output store
        self.header = InputHeader(len(engine.buffers.block_tables), self.device)
        self.first_graphs: dict[int, Callable[[], None]] = {}
        self.loop_graphs: dict[int, Callable[[], None]] = {}
        self.combined_graphs: dict[tuple[int, int], Callable[[], None]] = {}
        use_combined = cfg.combined_graphs if combined is None else combined
        self.combined_sizes = decode_size_pairs(cfg, self.width, self.token_sizes, self.batch_sizes) \
            if use_combined else []
        self.pool = None
        self.stream = None  # the capture stream, this runner's alone (private_stream)
        shard = getattr(engine.head, "shard", None)
        self.sharded = shard is not None and shard.world > 1  # NCCL collectives inside the graphs
        self.graphs: list = []  # keeps captured CUDAGraph objects alive
        self.replays = 0  # calls answered by graphs
        self.combined_replays = 0  # of which by one combined graph
        self.folded_replays = 0  # of which by a combined graph with a bound binding's guard inside (capture_folded)

    # ------------------------------------------------------------------ capture
    @property
    def captured(self) -> bool:
        return bool(self.first_graphs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph, largest first, into one memory pool."""
        if self.captured:
            return
        if not self.emulate:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = private_stream(self.device)
            if self.sharded:
                open_communicator(self.device)
        neutralize(self.engine.buffers)  # warm-up runs must write no KV
        self.header.clear()
        for t, b in reversed(self.combined_sizes):
            self.combined_graphs[(t, b)] = self._capture(lambda t=t, b=b: self._combined(t, b))
        for t in reversed(self.token_sizes):
            self.first_graphs[t] = self._capture(lambda t=t: self._first_pass(t))
        for b in reversed(self.batch_sizes):
            self.loop_graphs[b] = self._capture(lambda b=b: self._loop(b))

    # ------------------------------------------------------------------ other modules' graphs
    def capture_extra(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Capture fn (drafter.engine.predraft's one-replay pre-drafts) into this runner's pool on its
        private stream, after the draft graphs; returns its replay (emulated: fn itself, run once).
        Only one graph runs at a time, so fn's intermediates may share the pool; its outputs must
        live outside it (tensors allocated before the capture)."""
        self.capture()
        return self._capture(fn)

    @torch.inference_mode()
    def capture_folded(self, prologue: Callable[[], None]) -> tuple[dict[tuple[int, int], Callable[[], None]],
                                                                    Callable[[], None]]:
        """Graphs that run `prologue` (a bound binding's step guard, drafter.engine.bound.fold) at
        the start of the engine's: one per combined decode pair (prologue + first pass + loop: a
        bound decode step is then ONE replay), and the prologue alone for the other sizes (its
        replay, then the first-pass and loop graphs').  prologue reads only the header and tensors
        allocated before this call.  Captured in this runner's pool on its private stream, with
        the header cleared first (the warm-up runs read and write nothing through it), in
        "thread_local" mode: a binding is made while other threads may make CUDA calls of their
        own (a channel's send, a client in the same process); the caller holds the engine (no
        replay of these graphs runs meanwhile).  The runner keeps no reference to them: they live
        as long as the returned replays (the binding's), so a binding gone frees its graphs.
        Emulated: the functions, each run once."""
        self.capture()
        self.header.wait_until_read()
        neutralize(self.engine.buffers)
        self.header.clear()
        folded = {(t, b): self._capture(lambda t=t, b=b: (prologue(), self._combined(t, b)), "thread_local",
                                        keep=False)
                  for t, b in reversed(self.combined_sizes)}
        return folded, self._capture(prologue, "thread_local", keep=False)

    def replay_folded(self, graph: Callable[[], None]) -> None:
        """Replay one of capture_folded's combined graphs for a call the header already describes."""
        graph()
        self.header.loaded()
        self.combined_replays += 1
        self.folded_replays += 1
        self.replays += 1

    def _capture(self, fn: Callable[[], None], mode: str | None = None, keep: bool = True) -> Callable[[], None]:
        """mode: torch.cuda.graph's capture_error_mode (default: "thread_local" for a sharded head,
        whose watchdog thread queries events meanwhile, else "global"); keep: the runner keeps the
        graph alive (else the returned replay alone does)."""
        if self.emulate:
            # a "replay" runs the torch ops again: outside inference mode they would record autograd
            replay = torch.inference_mode()(fn)
            replay()
            return replay
        # warm up on a side stream first: Triton compiles and cuBLAS picks its kernels outside capture
        # (never on self.stream: its cuBLAS workspace must be allocated inside the capture, in the pool)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if mode is None:
            mode = "thread_local" if self.sharded else "global"
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode=mode):
            fn()
        if keep:
            self.graphs.append(graph)
        # the C++ replay itself where torch exposes it: the Python override adds a per-call check
        native = getattr(torch._C._CUDAGraph, "replay", None)
        return native.__get__(graph) if native is not None else graph.replay

    def _first_pass(self, num_tokens: int, batch: int | None = None) -> None:
        """batch: the requests its attention metadata covers, at least the call's (default: any
        call of num_tokens tokens, min(num_tokens, the largest batch))."""
        e = self.engine
        load_inputs(self.header.device, e.buffers, num_tokens, self.meta_batch)
        batch = min(num_tokens, self.meta_batch) if batch is None else batch
        logit_h, carry_h = e.proposer.first_pass_all_rows(e.buffers, num_tokens, batch)
        rows = e.buffers.sample_indices[:batch]  # gathered straight into the hand-off tensors
        torch.index_select(logit_h, 0, rows, out=self.first_logit_h[:batch])
        torch.index_select(carry_h, 0, rows, out=self.first_carry_h[:batch])
        torch.index_select(e.buffers.positions, 0, rows, out=self.first_pos[:batch])

    def _loop(self, batch: int) -> None:
        e = self.engine
        first = (self.first_logit_h[:batch], self.first_carry_h[:batch], self.first_pos[:batch])
        if e.config.speculative_token_tree:
            drafts = e.proposer.tree_drafts(e.buffers, batch, batch, first)
        else:
            drafts = e.proposer.chain(e.buffers, batch, batch, first, None, None, False)
        store_drafts(self.header.device, drafts.token_ids)  # the real rows, into the call's output

    def _combined(self, num_tokens: int, batch: int) -> None:
        self._first_pass(num_tokens, batch)  # a decode call of at most `batch` requests (decode_size_pairs)
        self._loop(batch)

    # ------------------------------------------------------------------ replay
    def handles(self, inp: ProposeInputs, batch_padded: int, tokens_padded: int, want_probs: bool,
                want_logits: bool) -> bool:
        return (inp.temperatures is None and not want_probs and not want_logits
                and batch_padded in self.batch_sizes and tokens_padded in self.token_sizes)

    def new_output(self, batch: int) -> torch.Tensor:
        """The call's drafts, [batch, k | nodes] int64: a fresh tensor the caller owns."""
        return self._drafts_like.new_empty((batch, self.width))  # no dtype / device arguments to parse

    def run(self, inp: ProposeInputs, tokens_padded: int, batch_padded: int) -> torch.Tensor:
        """Describe the call in the header and replay its graph(s); returns the drafts
        [batch, k | nodes] int64 in a fresh tensor (written by the GPU, stream-ordered).  The
        caller's tensors must stay unchanged until the GPU has run the graphs (tensors on the
        current stream are: later work on it comes after)."""
        if not self.captured:
            self.capture()
        out = self.new_output(inp.next_token_ids.shape[0])
        self.header.write(on_device(inp, self.device), out)
        self.replay(tokens_padded, batch_padded)
        return out

    def replay(self, tokens_padded: int, batch_padded: int) -> None:
        """Replay the graphs (captured: capture() rewrites the header) of a call the header
        already describes (run, or drafter.engine.bound)."""
        combined = self.combined_graphs.get((tokens_padded, batch_padded))
        if combined is not None:
            combined()
            self.combined_replays += 1
        else:
            self.first_graphs[tokens_padded]()
            self.loop_graphs[batch_padded]()
        self.header.loaded()  # after the last replay that reads the header
        self.replays += 1


def decode_size_pairs(cfg, width: int, token_sizes: list[int], batch_sizes: list[int]) -> list[tuple[int, int]]:
    """The (tokens_padded, batch_padded) pairs of decode calls, sorted: b requests of width + 1
    tokens each (the bonus token and the drafts verified, rejected ones kept), for every b up to
    the largest batch captured, where both padded sizes were captured."""
    pairs = set()
    for b in range(1, max(batch_sizes, default=0) + 1):
        n = b * (width + 1)
        if n > cfg.token_capture_sizes[-1]:
            break
        pair = (pad_to_capture_size(n, cfg.token_capture_sizes), pad_to_capture_size(b, cfg.capture_sizes))
        if pair[0] in token_sizes and pair[1] in batch_sizes:
            pairs.add(pair)
    return sorted(pairs, key=lambda p: (p[1], p[0]))


def on_device(inp: ProposeInputs, device: torch.device) -> ProposeInputs:
    """The call's tensors where the captured loader can read them: on the engine's device (a no-op
    for an in-process caller on the GPU), or left in pinned host memory, which the GPU reads in
    place (the service stages every call there: no copy launch per tensor).  A pinned tensor the
    header would have to convert (not contiguous) moves too: its converted copy would be pageable."""
    def move(t):
        if t is None or readable_in_place(t, device):
            return t
        return t.to(device, non_blocking=True)
    if inp.target_token_ids.device == device and inp.target_hidden_states.device == device:
        return inp
    return ProposeInputs(*(move(getattr(inp, f)) for f in (
        "target_token_ids", "target_positions", "target_hidden_states", "next_token_ids", "query_start_loc",
        "seq_lens")), [move(t) for t in inp.block_tables], [move(t) for t in inp.slot_mappings],
        move(inp.token_indices_to_sample), move(inp.num_rejected_tokens), move(inp.temperatures))


def readable_in_place(t: torch.Tensor, device: torch.device) -> bool:
    """Whether the captured loader reads t where it is: on `device`, or contiguous in pinned host
    memory when `device` is a GPU."""
    if t.device == device:
        return True
    return device.type == "cuda" and t.device.type == "cpu" and t.is_contiguous() and t.is_pinned()


def open_communicator(device: torch.device) -> None:
    """One eager all-reduce on the process group, waited for: NCCL's communicator exists before a
    capture records collectives on it (every rank of the group must call this together)."""
    probe = torch.zeros(1, device=device)
    torch.distributed.all_reduce(probe)
    torch.cuda.synchronize(device)


def neutralize(buf) -> None:
    """Put the static buffers in a state where a forward reads and writes no KV at all."""
    buf.query_start_loc.zero_()
    buf.seq_lens.zero_()
    buf.sample_indices.zero_()
    buf.positions.zero_()
    buf.input_ids.zero_()
    for table, slots in zip(buf.block_tables, buf.slot_mappings):
        table.zero_()
        slots.fill_(PADDING_SLOT_ID)
