"""RemoteEagleProposer: vLLM 0.32's EAGLE proposer, with the drafting done by a drafter service.

vLLM's runner builds this instead of its EagleProposer when the plugin is configured
(install.py).  What changes, method by method:
  * load_model: the draft head is not built, so its weights never reach the target's device and
    its attention layer never registers: vLLM allocates no draft KV cache either (the target's
    KV pool gets that memory).  What vLLM still needs from the head (EAGLE-3's aux hidden state
    layer ids; the draft vocabulary only matters inside the drafter) comes from the head's
    config.json, which vLLM reads on its own when it builds the speculative config.
  * initialize_attn_backend: no draft layers to build metadata for; only picks the KV group whose
    block table and slot mapping travel to the drafter (the drafter's pool mirrors its block ids).
  * dummy_run / validate_same_kv_cache_group: nothing local to warm up or check.
  * propose: sends exactly the tensors vLLM passes in (from TP rank 0 only), broadcasts the
    [batch, k] drafts to the other TP ranks, and fails closed (fallback.py).
The base class's helpers the runner calls around propose (prepare_next_token_ids_padded,
prepare_inputs_padded, prepare_inputs, ...) are inherited unchanged: they shape the inputs the
in-process drafter would have received, which is exactly what the drafter needs.
"""

from __future__ import annotations

import logging

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.spec_decode.eagle import EagleProposer

from drafter_vllm.link import DrafterLink, log_serve_flags
from drafter_vllm.settings import PluginSettings
from drafter_vllm.sources import TargetFacts, check_transport

log = logging.getLogger("vllm.drafter_vllm")  # under "vllm": shows in vLLM's log


class RemoteEagleProposer(EagleProposer):
    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner=runner)
        self.settings = PluginSettings.from_vllm_config(vllm_config)
        check_transport(self.settings)
        if self.uses_mrope:
            raise ValueError("drafter plugin: M-RoPE draft models are not supported by the drafter service")
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.target_hidden_size = vllm_config.model_config.get_hidden_size()
        self.target_dir = vllm_config.model_config.model
        self.head_dir = self.draft_model_config.model
        self.num_kv_blocks = 0
        self.link = DrafterLink(self.settings, vocab_size=self.vocab_size, device=self.device, facts=self._facts)
        if self.speculative_config.draft_sample_method == "probabilistic":
            log.warning("drafter plugin: the drafter proposes greedy drafts; draft_sample_method="
                        "'probabilistic' is ignored (verification stays lossless)")
        log.info("drafter plugin: %s drafting for %s goes to %s over %s (deadline %.0f ms); the head "
                 "is not loaded here", self.method, self.target_dir, ",".join(self.settings.endpoints) or "-",
                 self.settings.transport, self.settings.deadline_ms)

    @property
    def stats(self) -> dict:  # calls / drafted / fallback of this worker (TP rank 0 counts calls)
        return self.link.stats

    @property
    def source(self):  # the coordinator's RemoteProposer, once TP rank 0 made its first call
        return self.link.source

    # ------------------------------------------------------------------ set-up hooks
    def load_model(self, target_model) -> None:
        self._draft_attn_layer_names = set()
        # the drafter sees token ids and hidden states only; multimodal embeddings stay here
        self.supports_mm_inputs = False

    def validate_same_kv_cache_group(self, kv_cache_config) -> None:
        return None

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        gid = mirrored_group(kv_cache_config)
        spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
        kernel = spec.block_size
        if kernel_block_sizes is not None and gid < len(kernel_block_sizes) and kernel_block_sizes[gid]:
            # block tables and slot mappings are written in kernel blocks when they differ
            kernel = int(kernel_block_sizes[gid])
        self.kv_cache_gid = gid
        self.block_size = kernel
        self.num_kv_blocks = int(kv_cache_config.num_blocks) * (spec.block_size // kernel)
        self.draft_attn_groups = []
        log_serve_flags(self._facts(self.target_hidden_size))

    def dummy_run(self, *args, **kwargs) -> None:
        return None

    # ------------------------------------------------------------------ the step
    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None) -> torch.Tensor:
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None  # greedy drafts: vLLM verifies them as one-hot proposals
        cad = common_attn_metadata
        batch, k = cad.batch_size(), int(num_speculative_tokens)
        next_ids = next_token_ids[:batch]
        return self.link.step(k, batch, next_ids, lambda: v1_engine_kwargs(
            batch, target_token_ids, target_positions, target_hidden_states, next_ids, token_indices_to_sample, cad,
            num_rejected_tokens_gpu))

    def _facts(self, hidden_width: int) -> TargetFacts:
        num_aux = 0
        if self.method == "eagle3" and self.eagle3_use_aux_hidden_state:
            num_aux = hidden_width // self.target_hidden_size
        sched = self.vllm_config.scheduler_config
        dp = self.vllm_config.parallel_config.data_parallel_rank
        return TargetFacts(
            method=self.method, num_speculative_tokens=self.speculative_config.num_speculative_tokens,
            hidden_size=self.target_hidden_size, num_aux_layers=num_aux,
            dtype=str(self.dtype).replace("torch.", ""), max_model_len=self.max_model_len,
            max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
            block_size=self.block_size, num_blocks=self.num_kv_blocks,
            padded_drafter_batch=not self.speculative_config.disable_padded_drafter_batch,
            head_dir=str(self.head_dir), target_dir=str(self.target_dir), device=str(self.device),
            client=f"{self.target_dir}/dp{dp}")


def v1_engine_kwargs(batch: int, token_ids, positions, hidden, next_ids, sample_idx, cad, num_rejected) -> dict:
    """The V1 proposer's arguments -> DraftEngine.propose's keywords, cut to this step's rows.

    token_ids / positions: [>= num_tokens]; hidden: [>= num_tokens, width]; next_ids: [batch];
    sample_idx, num_rejected: [>= batch] or None (unpadded drafter batch)."""
    num_tokens = int(cad.num_actual_tokens)
    return dict(
        target_token_ids=token_ids[:num_tokens], target_positions=positions[:num_tokens],
        target_hidden_states=hidden[:num_tokens], next_token_ids=next_ids,
        query_start_loc=cad.query_start_loc[: batch + 1], seq_lens=cad.seq_lens[:batch],
        block_tables=cad.block_table_tensor[:batch], slot_mappings=cad.slot_mapping[:num_tokens],
        token_indices_to_sample=None if sample_idx is None else sample_idx[:batch],
        num_rejected_tokens=None if num_rejected is None else num_rejected[:batch])


def mirrored_group(kv_cache_config) -> int:
    """The KV group an in-process EAGLE head would have joined: plain full attention."""
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, FullAttentionSpec) and not isinstance(spec, MLAAttentionSpec):
            return gid
    raise ValueError("drafter plugin: the target has no full-attention KV cache group for the drafter to "
                     f"mirror (groups: {[type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]})")
