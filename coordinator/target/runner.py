"""The reference target's model runner: the tiny Llama over its own paged KV cache.

It reuses the drafter's LlamaForCausalLM, PagedKVCache and ReferenceBackend, so the target and
the drafter share one definition of paged attention.  Besides logits it returns the hidden
states a drafter consumes: the final-normed state (EAGLE-1, MTP) or the concatenated aux
residual streams (EAGLE-3, extract_hidden_states).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter.attention import AttentionMetadata, ReferenceBackend
from drafter.engine.config import KVGroupSpec
from drafter.engine.kv_cache import PagedKVCache
from drafter.models.llama import LlamaForCausalLM
from drafter.models.loader import load_target

# which hidden states each drafter method consumes
AUX_METHODS = ("eagle3", "extract_hidden_states")


@dataclass(frozen=True)
class RunnerConfig:
    target_dir: str
    block_size: int = 16
    num_blocks: int = 128
    aux_layer_ids: tuple[int, ...] = ()  # empty = send the final-normed hidden state
    dtype: str = "float32"


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [num_tokens, vocab]
    drafter_hidden: torch.Tensor  # [num_tokens, hidden] or [num_tokens, len(aux_layer_ids) * hidden]


class ModelRunner:
    def __init__(self, cfg: RunnerConfig, *, model: LlamaForCausalLM | None = None, backend=None):
        """model: a target built in memory (its device holds the KV cache too; cfg.target_dir is then
        not read), e.g. random weights at a real model's shapes on a GPU (coordinator.bench.e2e_step);
        None loads cfg.target_dir on the CPU.  backend: the paged attention (None: ReferenceBackend)."""
        self.cfg = cfg
        dtype = getattr(torch, cfg.dtype)
        self.model = model if model is not None else load_target(cfg.target_dir, dtype=dtype)
        self.spec = self.model.spec
        self.device = self.model.embed_tokens.weight.device
        groups = tuple(KVGroupSpec(cfg.block_size, cfg.num_blocks) for _ in range(self.spec.num_kv_groups))
        self.kv = PagedKVCache(self.spec.layer_shapes, self.spec.kv_group_of_layer, groups, self.device, dtype)
        self.backend = backend or ReferenceBackend()

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def drafter_hidden_width(self) -> int:
        return self.spec.hidden_size * max(1, len(self.cfg.aux_layer_ids))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        query_start_loc: torch.Tensor,  # [batch + 1] int32
        seq_lens: torch.Tensor,  # [batch] int32, including this step's tokens
        block_table: torch.Tensor,  # [batch, blocks_per_req] int32
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> ForwardOutput:
        if self.device.type != "cpu":  # the engine builds a step's inputs on the host
            input_ids, positions, query_start_loc, seq_lens, block_table, slot_mapping = (
                t.to(self.device, non_blocking=True)
                for t in (input_ids, positions, query_start_loc, seq_lens, block_table, slot_mapping))
        meta = AttentionMetadata(query_start_loc, seq_lens, block_table, slot_mapping, self.cfg.block_size)
        metas = [meta] * self.spec.num_kv_groups  # one block-id space for every group of the target
        out = self.model(input_ids, positions, self.kv.layers, metas, self.backend, self.cfg.aux_layer_ids)
        hidden = out.aux_hidden_states if self.cfg.aux_layer_ids else out.hidden_states
        return ForwardOutput(out.logits, hidden)
