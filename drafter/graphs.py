"""CUDA graphs for the draft engine: one first-pass graph per token capture size and one graph
of the whole draft loop (chain or tree) per batch capture size.

    runner = GraphRunner(engine)      # engine: a DraftEngine on CUDA with the Triton backend
    runner.capture()                  # optional: done by the first run() otherwise
    ids = runner.run(inp, t_pad, b_pad)   # [b_pad, k] int64, a view of a static buffer

Both graphs read only the engine's StaticBuffers and a few static hand-off tensors, so one
replay serves any batch padded to its size:
  * the first pass over t tokens runs with attention metadata for min(t, largest batch) requests
    (a batch never has more requests than tokens); the requests past the call's batch have
    query length 0 and seq_len 0 and read nothing; that keys its graph by token count alone;
  * its sampled rows are copied into static tensors that the loop graph reads;
  * padded rows have slot -1 and seq_len 0 in the buffers: they write and read nothing;
  * the loop decides which rows are live from the buffers (seq_len > 0), never from a host int.
Graphs are captured largest first into one shared memory pool: only one graph runs at a time,
so their intermediates may share memory; what must outlive a replay lives outside the pool.

Greedy drafting only: a call with temperatures, or asking for probabilities or logits, runs
eagerly, as does a call above the largest size captured.

`emulate=True` (tests on CPU) "captures" a step by keeping the function and "replays" it by
calling it again: the same static-buffer data flow, checkable where no GPU exists.
"""

from __future__ import annotations

from typing import Callable

import torch

from drafter.attention.kernels.batch_inputs import InputHeader, load_inputs
from drafter.attention.metadata import PADDING_SLOT_ID
from drafter.inputs import ProposeInputs


class GraphRunner:
    def __init__(self, engine, max_batch: int | None = None, max_tokens: int | None = None, emulate: bool = False):
        """max_batch / max_tokens: capture only sizes up to these (larger calls run eagerly)."""
        cfg = engine.config
        self.engine = engine
        self.emulate = emulate
        self.batch_sizes = [s for s in cfg.capture_sizes if max_batch is None or s <= max_batch]
        self.token_sizes = [s for s in cfg.token_capture_sizes if max_tokens is None or s <= max_tokens]
        # the first pass always runs with metadata for the buffers' full batch (see module doc)
        self.meta_batch = cfg.capture_sizes[-1]
        dev, dtype = engine.device, cfg.torch_dtype
        h = engine.spec.hidden_size
        width = cfg.num_tree_nodes or cfg.num_speculative_tokens
        # hand-off from the first-pass graph to the loop graph, outside the graph pool
        self.first_logit_h = torch.zeros(self.meta_batch, h, dtype=dtype, device=dev)  # [max_batch, hidden]
        self.first_carry_h = torch.zeros(self.meta_batch, h, dtype=dtype, device=dev)  # [max_batch, hidden]
        self.first_pos = torch.zeros(self.meta_batch, dtype=torch.long, device=dev)  # [max_batch]
        self.drafts = torch.zeros(self.meta_batch, width, dtype=torch.long, device=dev)  # [max_batch, k | nodes]
        # the call's sizes and tensor addresses, read by the loader captured in each first-pass graph
        self.header = InputHeader(len(engine.buffers.block_tables), engine.buffers.input_ids.device)
        self.first_graphs: dict[int, Callable[[], None]] = {}
        self.loop_graphs: dict[int, Callable[[], None]] = {}
        self.pool = None
        self.graphs: list = []  # keeps captured CUDAGraph objects alive
        self.replays = 0

    # ------------------------------------------------------------------ capture
    @property
    def captured(self) -> bool:
        return bool(self.first_graphs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool."""
        if self.captured:
            return
        if not self.emulate:
            self.pool = torch.cuda.graph_pool_handle()
        neutralize(self.engine.buffers)  # warm-up runs must write no KV
        self.header.device.zero_()  # a header of 0 tokens and 0 requests: the loader reads nothing
        for t in reversed(self.token_sizes):
            self.first_graphs[t] = self._capture(lambda t=t: self._first_pass(t))
        for b in reversed(self.batch_sizes):
            self.loop_graphs[b] = self._capture(lambda b=b: self._loop(b))

    def _capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        if self.emulate:
            fn()
            return fn
        # warm up on a side stream first: Triton compiles and cuBLAS picks its kernels outside capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        self.graphs.append(graph)
        return graph.replay

    def _first_pass(self, num_tokens: int) -> None:
        e = self.engine
        load_inputs(self.header.device, e.buffers, num_tokens, self.meta_batch)
        batch = min(num_tokens, self.meta_batch)
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
        self.drafts[:batch].copy_(drafts.token_ids)

    # ------------------------------------------------------------------ replay
    def handles(self, inp: ProposeInputs, batch_padded: int, tokens_padded: int, want_probs: bool,
                want_logits: bool) -> bool:
        return (inp.temperatures is None and not want_probs and not want_logits
                and batch_padded in self.batch_sizes and tokens_padded in self.token_sizes)

    def run(self, inp: ProposeInputs, tokens_padded: int, batch_padded: int) -> torch.Tensor:
        """Describe the batch to the loader, replay both graphs; returns drafts [batch_padded, k | nodes]
        (a static view).  The caller's tensors must stay unchanged until the GPU has run the graphs
        (tensors on the current stream are: later work on it comes after)."""
        if not self.captured:
            self.capture()
        self.header.write(on_device(inp, self.engine.buffers.input_ids.device))
        self.first_graphs[tokens_padded]()
        self.header.loaded()
        self.loop_graphs[batch_padded]()
        self.replays += 1
        return self.drafts[:batch_padded]


def on_device(inp: ProposeInputs, device: torch.device) -> ProposeInputs:
    """The call's tensors on the engine's device (a no-op for an in-process caller on the GPU)."""
    def move(t):
        return t if t is None or t.device == device else t.to(device, non_blocking=True)
    if inp.target_token_ids.device == device and inp.target_hidden_states.device == device:
        return inp
    return ProposeInputs(*(move(getattr(inp, f)) for f in (
        "target_token_ids", "target_positions", "target_hidden_states", "next_token_ids", "query_start_loc",
        "seq_lens")), [move(t) for t in inp.block_tables], [move(t) for t in inp.slot_mappings],
        move(inp.token_indices_to_sample), move(inp.num_rejected_tokens), move(inp.temperatures))


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
