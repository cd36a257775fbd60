"""The in-process draft engine: load a head, own its paged KV pool, answer propose calls.

    engine = DraftEngine.from_dirs("head/", target_dir="target/", config=EngineConfig(method="eagle3"))
    out = engine.propose(target_token_ids=..., target_positions=..., ...)   # vLLM's proposer inputs
    out.draft_token_ids                                                     # [batch, k]
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from drafter.attention import ReferenceBackend
from drafter.engine.buffers import StaticBuffers
from drafter.engine.config import EngineConfig, check_mtp_layers, pad_to_capture_size
from drafter.engine.inputs import Limits, as_group_list
from drafter.engine.inputs import validate as check_inputs
from drafter.engine.kv_cache import HiddenStateStore, PagedKVCache
from drafter.models.loader import load_head
from drafter.models.sharding import SINGLE, Shard
from drafter.models.spec import ModelSpec, parse_head, read_config
from drafter.engine.predraft import pool_groups
from drafter.engine.proposer import Proposer
from drafter.wire.errors import InvalidInput
from drafter.wire.records import DraftOutput, ProposeInputs

if TYPE_CHECKING:
    from drafter.engine.bound import BoundPropose
    from drafter.wire.predraft import PreDrafts


def make_backend(name: str, device: torch.device):
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        try:
            from drafter.attention.triton_backend import TritonBackend
        except ImportError:
            if name == "triton":
                raise
        else:
            return TritonBackend()
    return ReferenceBackend()


class DraftEngine:
    def __init__(self, head, spec: ModelSpec, config: EngineConfig):
        self.config = config
        self.spec = spec
        self.head = head
        self.device = torch.device(config.device)
        check_mtp_layers(config, spec.num_layers)
        if getattr(head, "shard", SINGLE).world > 1 and config.weights == "fp8":
            raise ValueError("weights='fp8' (--weights fp8) with a tensor-parallel head: per-channel FP8 runs on "
                             "the single-process fused path only; use bf16 or --tensor-parallel-size 1")
        if head is not None and config.weights == "fp8":  # before the fused path plans its kernels
            from drafter.models.fp8 import quantize_head

            quantize_head(head)  # per-channel FP8 GEMM weights (idempotent: engines may share a head)
        dtype = config.torch_dtype
        self.backend = make_backend(config.attention_backend, self.device)
        if spec.method == "extract_hidden_states":
            self.store = HiddenStateStore(config.kv_groups[0], len(spec.aux_layer_ids), spec.target_width,
                                          self.device, dtype)
            self.kv = None
        else:
            # pre-drafting's scratch blocks sit after the configured ones (the limits below keep calls off them)
            self.kv = PagedKVCache(spec.layer_shapes, spec.kv_group_of_layer, pool_groups(config), self.device, dtype)
            self.store = None
        self.buffers = StaticBuffers(config.token_capture_sizes[-1], config.capture_sizes[-1],
                                     spec.hidden_input_width, config.max_blocks_per_req,
                                     tuple(g.block_size for g in config.kv_groups), self.device, dtype)
        self.proposer = None if head is None else Proposer(
            head, self.kv.layers, self.backend, config.num_speculative_tokens, config.max_model_len,
            config.speculative_token_tree, config.mtp_layer_schedule or "per_step")
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.graphs = None
        # a tensor-parallel head (world > 1) fuses only what is exact on a shard
        # (drafter.models.shard_fusion: fuse_head's o / down epilogues would add the residual to a
        # rank's partial sum); deepseek_mtp's MLA / MoE layers run drafter.kernels' own at any world.
        # CUDA graphs capture a sharded step with its collectives inside (drafter.engine.graphs)
        sharded = getattr(head, "shard", SINGLE).world > 1
        if head is not None and self.backend.name == "triton":  # imported here: these need triton
            with self.on_device():  # fusion times its kernel candidates on the engine's GPU
                self._fuse_and_graph(spec, config, sharded)
        span = config.num_tree_nodes or config.num_speculative_tokens - 1
        self.limits = Limits(
            max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, vocab_size=spec.vocab_size,
            hidden_width=spec.hidden_input_width, num_blocks=tuple(g.num_blocks for g in config.kv_groups),
            block_sizes=tuple(g.block_size for g in config.kv_groups), draft_span=span)

    def _fuse_and_graph(self, spec: ModelSpec, config: EngineConfig, sharded: bool) -> None:
        """The Triton path's fused head and, on a GPU, its CUDA graph runner."""
        from drafter.engine.graphs import GraphRunner
        from drafter.models.fusion import fuse_head
        from drafter.models.shard_fusion import fuse_sharded_head

        # one q/k/v GEMM, rotary + KV write and norms in fused kernels; skinny GEMMs where faster
        if spec.method != "deepseek_mtp":
            (fuse_sharded_head if sharded else fuse_head)(self.head, config.skinny_gemm)
        if config.use_cuda_graphs and self.device.type == "cuda":
            # the draft loop as CUDA graphs: the Triton path never reads device values on the host
            self.graphs = GraphRunner(self)

    def on_device(self):
        """The engine's GPU as the current device for the calls below it, when another one is current:
        Triton launches and torch's default streams follow the current device, not the tensors', so an
        engine on cuda:1 called from a thread whose current device is cuda:0 would launch its kernels
        on the wrong GPU.  A no-op (one cheap query) when the engine's GPU is already current, and on
        the CPU.  CUDA graph replays set their own device."""
        d = self.device
        if d.type != "cuda" or d.index is None or d.index == torch.cuda.current_device():
            return nullcontext()
        return torch.cuda.device(d)

    @classmethod
    def from_dirs(cls, head_dir: str | Path, target_dir: str | Path | None = None,
                  config: EngineConfig | None = None, shard: Shard = SINGLE, **overrides) -> "DraftEngine":
        """shard: the tensor-parallel rank this engine is (every rank of the process group builds
        one and runs the same calls; drafter.service.tp drives them)."""
        if config is None:
            config = EngineConfig(**overrides)
        if config.method == "extract_hidden_states":
            return cls(None, parse_head(read_config(head_dir), config.method), config)
        head = load_head(head_dir, config.method, target_dir, device=config.device, dtype=config.torch_dtype,
                         max_model_len=config.max_model_len, shard=shard)
        return cls(head, head.spec, config)

    # ------------------------------------------------------------------ propose
    def propose(
        self,
        *,
        target_token_ids: torch.Tensor,  # [num_tokens] int
        target_positions: torch.Tensor,  # [num_tokens] int
        target_hidden_states: torch.Tensor,  # [num_tokens, hidden (x num aux layers)]
        next_token_ids: torch.Tensor,  # [batch] int
        query_start_loc: torch.Tensor,  # [batch + 1] int
        seq_lens: torch.Tensor,  # [batch] int
        block_tables,  # [batch, max_blocks] int, or a list of them (one per KV group)
        slot_mappings,  # [num_tokens] int, or a list of them (one per KV group)
        token_indices_to_sample: torch.Tensor | None = None,  # [batch] int
        num_rejected_tokens: torch.Tensor | None = None,  # [batch] int
        temperatures: torch.Tensor | None = None,  # [batch] float, 0 = greedy
        return_probs: bool = False,
        return_logits: bool = False,
        batch_padded: int | None = None,  # agreed across DP ranks; None = next capture size
        tokens_padded: int | None = None,
        validate: bool = True,
    ) -> DraftOutput:
        """Draft for one batch.  validate=True (the default, and what the service does) checks every
        tensor on the host first (drafter.engine.inputs.validate), which for GPU-resident inputs means a
        device sync and a dozen small copies per call.  validate=False is for a trusted in-process
        caller: inputs already checked by the target engine (the shapes, dtypes and ranges that
        validate() accepts); a malformed call then reads or writes the KV pool out of range."""
        groups = len(self.config.kv_groups)
        inp = ProposeInputs(
            target_token_ids, target_positions, target_hidden_states, next_token_ids, query_start_loc, seq_lens,
            as_group_list("block_tables", block_tables, groups), as_group_list("slot_mappings", slot_mappings, groups),
            token_indices_to_sample, num_rejected_tokens, temperatures)
        return self.draft(inp, return_probs=return_probs, return_logits=return_logits, batch_padded=batch_padded,
                          tokens_padded=tokens_padded, validate=validate)

    def draft(self, inp: ProposeInputs, *, return_probs: bool = False, return_logits: bool = False,
              batch_padded: int | None = None, tokens_padded: int | None = None, validate: bool = True
              ) -> DraftOutput:
        """propose() on a typed record (the service's engine thread calls this): block_tables and
        slot_mappings already one tensor per KV group."""
        with self.on_device():
            return self._draft(inp, return_probs, return_logits, batch_padded, tokens_padded, validate)

    def _draft(self, inp: ProposeInputs, return_probs: bool, return_logits: bool, batch_padded, tokens_padded,
               validate: bool) -> DraftOutput:
        if validate:
            groups = len(self.config.kv_groups)
            as_group_list("block_tables", inp.block_tables, groups)
            as_group_list("slot_mappings", inp.slot_mappings, groups)
            check_inputs(inp, self.limits)
        if self.config.method == "extract_hidden_states":
            return self._extract(inp)
        if inp.num_rejected_tokens is not None and not self.config.padded_drafter_batch:
            inp = drop_rejected_tokens(inp)
        return self._propose_validated(inp, return_probs, return_logits, batch_padded, tokens_padded)

    def predraft(self, inp: ProposeInputs,
                 drafts: torch.Tensor,  # [batch, k..max(k, k')] int: the drafts the target verifies, -1 = none
                 step: int, outcomes: int | None = None) -> "PreDrafts":
        """The next step's drafts for each request's likeliest verification outcomes
        (drafter.engine.predraft), keyed by `step`; `outcomes` of them per request (default and
        most: predraft_outcomes).  Call it right after draft(inp) ran: the context's KV is read
        from the pool; only scratch blocks are written."""
        from drafter.engine.predraft import predraft

        if not self.config.predraft_outcomes:
            raise InvalidInput("predraft_outcomes", "pre-drafting is off (predraft_outcomes = 0)")
        if outcomes is not None and not 1 <= outcomes <= self.config.predraft_outcomes:
            raise InvalidInput("outcomes", f"{outcomes}: must be 1 .. predraft_outcomes "
                               f"({self.config.predraft_outcomes})")
        if inp.temperatures is not None and bool((inp.temperatures > 0).any()):
            raise InvalidInput("temperatures", "pre-drafts are greedy drafts; probabilistic drafts are not supported")
        k, deepest = self.config.num_speculative_tokens, max(self.config.num_speculative_tokens, self.config.predraft_k)
        if drafts.dim() != 2 or drafts.shape[0] != inp.batch_size or not k <= drafts.shape[1] <= deepest:
            # after hits on deeper pre-drafts (k' > k) the target verifies k' drafts
            raise InvalidInput("drafts", f"expected [{inp.batch_size}, {k}..{deepest}], got {tuple(drafts.shape)}")
        with self.on_device():
            return predraft(self, inp, drafts, step, outcomes)

    def bind(
        self,
        *,
        target_token_ids: torch.Tensor,  # [max_tokens] int
        target_positions: torch.Tensor,  # [max_tokens] int
        target_hidden_states: torch.Tensor,  # [max_tokens, hidden (x num aux layers)]
        next_token_ids: torch.Tensor,  # [max_batch] int
        query_start_loc: torch.Tensor,  # [max_batch + 1] int
        seq_lens: torch.Tensor,  # [max_batch] int
        block_tables,  # [max_batch, >= max_blocks_per_req] int, or a list of them (one per KV group)
        slot_mappings,  # [max_tokens] int, or a list of them (one per KV group)
        token_indices_to_sample: torch.Tensor | None = None,  # [max_batch] int
        num_rejected_tokens: torch.Tensor | None = None,  # [max_batch] int
        drafts: torch.Tensor | None = None,  # [max_batch, k | nodes] int64; None: allocated here
    ) -> "BoundPropose":
        """A trusted caller's persistent input buffers, described once: each step the caller
        fills their first rows and calls bound.propose(num_tokens, batch_size) (drafter.engine.bound).
        The buffers are read in place, so they must be kernel-readable as they are (contiguous,
        int32 / int64, bf16 / fp16 / fp32 hidden states) on the engine's device or pinned."""
        from drafter.engine.bound import BoundPropose

        if num_rejected_tokens is not None and not self.config.padded_drafter_batch:
            raise InvalidInput("num_rejected_tokens", "bound calls use the padded drafter batch (the graphs' path)")
        groups = len(self.config.kv_groups)
        inp = ProposeInputs(
            target_token_ids, target_positions, target_hidden_states, next_token_ids, query_start_loc, seq_lens,
            as_group_list("block_tables", block_tables, groups), as_group_list("slot_mappings", slot_mappings, groups),
            token_indices_to_sample, num_rejected_tokens)
        if drafts is None and self.graphs is not None:
            drafts = torch.empty(self.config.max_num_seqs, self.graphs.width, dtype=torch.int64, device=self.device)
        with self.on_device():  # the first binding captures the graphs
            return BoundPropose(self, inp, drafts)

    def _padded_sizes(self, inp: ProposeInputs, batch_padded, tokens_padded) -> tuple[int, int]:
        return self.padded_sizes(inp.next_token_ids.shape[0], inp.target_token_ids.shape[0], batch_padded,
                                 tokens_padded)

    def padded_sizes(self, batch: int, tokens: int, batch_padded: int | None = None,
                     tokens_padded: int | None = None) -> tuple[int, int]:
        """(batch_padded, tokens_padded) of a call: the next capture sizes, or the agreed ones
        (checked to cover the call and to lie within the largest capture size)."""
        c = self.config
        b = pad_to_capture_size(batch, c.capture_sizes) if batch_padded is None else batch_padded
        t = pad_to_capture_size(tokens, c.token_capture_sizes) if tokens_padded is None else tokens_padded
        if not batch <= b <= c.capture_sizes[-1]:
            raise InvalidInput("batch_padded", f"{b} must lie in [batch={batch}, {c.capture_sizes[-1]}]")
        if not tokens <= t <= c.token_capture_sizes[-1]:
            raise InvalidInput("tokens_padded", f"{t} must lie in [num_tokens={tokens}, {c.token_capture_sizes[-1]}]")
        return b, t

    def _propose_validated(self, inp: ProposeInputs, return_probs: bool, return_logits: bool, batch_padded,
                           tokens_padded):
        b_pad, t_pad = self._padded_sizes(inp, batch_padded, tokens_padded)
        graphs = self.graphs
        if graphs is not None and graphs.handles(inp, b_pad, t_pad, return_probs, return_logits):
            # no inference_mode here: replays record no autograd, and entering it costs host time
            return DraftOutput(graphs.run(inp, t_pad, b_pad), None, b_pad, t_pad)
        return self._propose_eager(inp, return_probs, return_logits, b_pad, t_pad)

    @torch.inference_mode()
    def _propose_eager(self, inp: ProposeInputs, return_probs: bool, return_logits: bool, b_pad: int,
                       t_pad: int) -> DraftOutput:
        buf = self.buffers
        buf.load(inp, t_pad, b_pad)
        first = self.proposer.first_pass(buf, t_pad, b_pad)
        if self.config.speculative_token_tree:
            drafts = self.proposer.tree_drafts(buf, b_pad, inp.batch_size, first)
        else:
            temps = buf.temperatures[:b_pad] if inp.temperatures is not None else None
            drafts = self.proposer.chain(buf, b_pad, inp.batch_size, first, temps, self.generator, return_probs,
                                         return_logits)
        b = inp.batch_size
        probs = drafts.probs[:b] if drafts.probs is not None else None
        if probs is not None and self.spec.draft_vocab_size != self.spec.vocab_size:
            probs = self._probs_in_target_vocab(probs)
        logits = drafts.logits[:b].clone() if drafts.logits is not None else None
        return DraftOutput(drafts.token_ids[:b].clone(), probs, b_pad, t_pad, logits)

    def _probs_in_target_vocab(self, probs: torch.Tensor) -> torch.Tensor:  # [b, k, Vd] -> [b, k, V]
        target_ids = torch.arange(self.spec.draft_vocab_size, device=probs.device) + self.head.d2t
        full = torch.zeros(*probs.shape[:2], self.spec.vocab_size, dtype=probs.dtype, device=probs.device)
        full[..., target_ids] = probs
        return full

    @torch.inference_mode()
    def _extract(self, inp: ProposeInputs) -> DraftOutput:
        """extract_hidden_states: store every token's aux states; the 'draft' is the sampled token."""
        self.store.write(inp.target_hidden_states.to(self.device), inp.slot_mappings[0].to(self.device).long())
        ids = inp.next_token_ids.to(self.device, torch.long)[:, None]
        return DraftOutput(ids.clone(), None, inp.batch_size, inp.num_tokens)

    def export_hidden_states(self, block_table_row: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """A request's stored aux hidden states, [num_tokens, num_aux, hidden] (extract_hidden_states)."""
        if self.store is None:
            raise InvalidInput("method", "export_hidden_states needs method extract_hidden_states")
        if not 0 < num_tokens <= self.config.max_model_len:
            raise InvalidInput("num_tokens", f"{num_tokens} not in (0, max_model_len]")
        bs = self.store.block_size
        needed = -(-num_tokens // bs)
        if block_table_row.dim() != 1 or block_table_row.shape[0] < needed:
            raise InvalidInput("block_table", f"needs at least {needed} entries")
        row = block_table_row[:needed]
        if int(row.min()) < 0 or int(row.max()) >= self.config.kv_groups[0].num_blocks:
            raise InvalidInput("block_table", "block id outside the pool")
        return self.store.read(row, num_tokens).clone()

    @property
    def graph_replays(self) -> int:
        """Calls served by CUDA-graph replay so far (the service's drafter_graph_replays_total)."""
        return self.graphs.replays if self.graphs is not None else 0

    def kv_snapshot(self) -> list[torch.Tensor]:
        return self.store.snapshot() if self.kv is None else self.kv.snapshot()


def drop_rejected_tokens(inp: ProposeInputs) -> ProposeInputs:
    """vLLM's unpadded path: remove each request's rejected tail before the first pass."""
    starts = inp.query_start_loc.tolist()
    rejected = inp.num_rejected_tokens.tolist()
    keep = torch.cat([torch.arange(starts[r], starts[r + 1] - rejected[r]) for r in range(inp.batch_size)])
    keep = keep.to(inp.target_token_ids.device)
    new_lens = torch.tensor([starts[r + 1] - starts[r] - rejected[r] for r in range(inp.batch_size)])
    qsl = torch.zeros(inp.batch_size + 1, dtype=inp.query_start_loc.dtype)
    qsl[1:] = torch.cumsum(new_lens, 0)
    return ProposeInputs(
        target_token_ids=inp.target_token_ids[keep],
        target_positions=inp.target_positions[keep],
        target_hidden_states=inp.target_hidden_states[keep],
        next_token_ids=inp.next_token_ids,
        query_start_loc=qsl.to(inp.query_start_loc.device),
        seq_lens=inp.seq_lens - inp.num_rejected_tokens.to(inp.seq_lens.device, inp.seq_lens.dtype),
        block_tables=inp.block_tables,
        slot_mappings=[s[keep] for s in inp.slot_mappings],
        temperatures=inp.temperatures,
    )
