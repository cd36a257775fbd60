"""RemoteEagleSpeculator: Model Runner V2's EAGLE speculator, with the drafting done by a drafter service.

vLLM 0.32 runs Model Runner V2 (vllm/v1/worker/gpu/model_runner.py) by default wherever Triton has
an active GPU driver.  That runner drafts through `init_speculator(...)`, which builds
`vllm.v1.worker.gpu.spec_decode.eagle.speculator.EagleSpeculator` for EAGLE-1 / EAGLE-3; install.py
makes that constructor build this subclass instead when remote drafting is configured (so every
isinstance check of the runner still holds).  Same guarantees as the V1 stand-in (proposer.py):
  * load_model: the head is not built: no weights on the target's device, no draft attention layer,
    hence no draft layer in vLLM's KV cache spec and no draft KV allocated (the runner derives both
    from the layers the head would have registered);
  * set_attn: no draft attention backend; only notes the full-attention KV group whose block table
    and slot mapping the drafter mirrors, and vLLM's block count;
  * init_cudagraph_manager / capture: nothing to capture;
  * propose: turns the tensors MRv2 passes (mrv2_engine_kwargs) into DraftEngine.propose's keywords,
    TP rank 0 sends them, the [batch, k] drafts are broadcast to the TP peers and written into the
    speculator's persistent draft_tokens buffer (what MRv2's runner reads); any failure gives
    fallback drafts (fallback.py), never an error;
  * dummy runs (warm-up, profiling) send nothing.
Refused at construction (ValueError naming the setting): adaptive verification (it reads the head's
confidences), watermarking (it samples drafts with the watermark), decode context parallelism (block
tables in another layout).  draft_sample_method='probabilistic' falls back to greedy drafts with
a warning: draft_logits is None, so vLLM verifies them as one-hot proposals (lossless).
"""

from __future__ import annotations

import logging

import torch
from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator

from drafter_vllm.hidden import bound_hidden_rows, join_layers
from drafter_vllm.link import DrafterLink, log_serve_flags
from drafter_vllm.proposer import mirrored_group
from drafter_vllm.settings import PluginSettings
from drafter_vllm.sources import TargetFacts, check_transport

log = logging.getLogger("vllm.drafter_vllm")  # under "vllm": shows in vLLM's log


class RemoteEagleSpeculator(EagleSpeculator):
    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.settings = PluginSettings.from_vllm_config(vllm_config)
        check_transport(self.settings)
        _refuse_unsupported(self)
        # the drafter never runs here: drop the buffer the local draft loop would have used
        self.hidden_states = self.hidden_states.new_empty((0, self.hidden_size))
        if self.draft_logits is not None:
            log.warning("drafter plugin: the drafter proposes greedy drafts; draft_sample_method="
                        "'probabilistic' is ignored (verification stays lossless)")
            self.draft_logits = None
        self.target_hidden_size = vllm_config.model_config.get_hidden_size()
        self.target_dir = vllm_config.model_config.model
        self.head_dir = self.draft_model_config.model
        self.model = None
        self.draft_attn_layer_names: set[str] = set()
        self.kv_cache_gid = 0
        self.block_size = 0
        self.num_kv_blocks = 0
        self.slot_layer = ""  # a layer of the mirrored group: its entry of MRv2's per-layer slot mappings
        self.link = DrafterLink(self.settings, vocab_size=vllm_config.model_config.get_vocab_size(),
                                device=self.device, facts=self._facts)
        log.info("drafter plugin: Model Runner V2 %s drafting for %s goes to %s over %s (deadline %.0f ms); the "
                 "head is not loaded here", self.method, self.target_dir, ",".join(self.settings.endpoints) or "-",
                 self.settings.transport, self.settings.deadline_ms)

    @property
    def stats(self) -> dict:
        return self.link.stats

    @property
    def source(self):
        return self.link.source

    # ------------------------------------------------------------------ set-up hooks
    def load_model(self, target_model) -> None:
        """No head: no weights here, no draft attention layer, so no draft KV in vLLM's pool."""
        self.model = None
        self.draft_attn_layer_names = set()
        self.supports_mm_inputs = False  # the drafter sees token ids and hidden states only
        self.acceptance_estimator = None

    def set_attn(self, model_state, kv_cache_config, block_tables, target_input_buffers, target_attn_groups) -> None:
        if self.pcp_manager is not None:
            raise ValueError("drafter plugin: prefill context parallelism is not supported with remote drafting")
        gid = mirrored_group(kv_cache_config)
        group = kv_cache_config.kv_cache_groups[gid]
        self.model_state = model_state
        self.kv_cache_config = kv_cache_config
        self.block_tables = block_tables
        self.attn_groups = []
        self.kv_cache_gid = gid
        # MRv2's block tables hold KV-manager block ids; slot ids are the same in any kernel block size
        self.block_size = int(group.kv_cache_spec.block_size)
        self.num_kv_blocks = int(kv_cache_config.num_blocks)
        self.slot_layer = group.layer_names[0]
        self.supports_decode_metadata_update = False
        log_serve_flags(self._facts(self.target_hidden_size))

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        self.prefill_cudagraph_manager = None
        self.decode_cudagraph_manager = None

    def capture(self) -> None:
        return None

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                dp_sync_state=None, dummy_run=False, skip_attn_for_dummy_run=False, mm_inputs=None,
                is_profile=False, num_speculative_tokens=None) -> torch.Tensor:
        """MRv2's call, as its runner makes it; returns draft_tokens[:num_reqs] ([num_reqs, k] int64)."""
        batch = int(input_batch.num_reqs)
        out = self.draft_tokens[:batch]
        if dummy_run or is_profile or batch == 0:
            return out  # warm-up / profiling / a rank without requests: nothing to draft
        k = self.num_speculative_steps
        next_ids = mrv2_next_token_ids(batch, input_batch.idx_mapping, num_sampled, last_sampled,
                                       next_prefill_tokens)
        slot_mapping = slot_mappings[self.slot_layer]
        block_table = self.block_tables.input_block_tables[self.kv_cache_gid]
        drafts = self.link.step(k, batch, next_ids, lambda: mrv2_engine_kwargs(
            input_batch, next_ids, slot_mapping, block_table, last_hidden_states, aux_hidden_states, num_rejected,
            hidden_out=self._bound_hidden(input_batch, aux_hidden_states)))
        out.copy_(drafts)
        return out

    def _bound_hidden(self, input_batch, aux_hidden_states) -> torch.Tensor | None:
        """EAGLE-3: the rows of the bound session's hidden buffer the layers go straight into
        (drafter_vllm.hidden); None (torch.cat) where there is none."""
        if not aux_hidden_states:
            return None
        first = aux_hidden_states[0]
        width = sum(h.shape[-1] for h in aux_hidden_states)
        return bound_hidden_rows(self.link.source, int(input_batch.num_tokens), width, first.dtype, first.device)

    def _facts(self, hidden_width: int) -> TargetFacts:
        sched = self.vllm_config.scheduler_config
        dp = self.vllm_config.parallel_config.data_parallel_rank
        return TargetFacts(
            method=self.method, num_speculative_tokens=self.num_speculative_steps,
            hidden_size=self.target_hidden_size,
            num_aux_layers=hidden_width // self.target_hidden_size if self.method == "eagle3" else 0,
            dtype=str(self.dtype).replace("torch.", ""), max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_reqs, max_num_batched_tokens=self.max_num_tokens,
            block_size=self.block_size, num_blocks=self.num_kv_blocks,
            # MRv2 always keeps the rejected tokens in the drafter's batch (vLLM's padded mode)
            padded_drafter_batch=True,
            head_dir=str(self.head_dir), target_dir=str(self.target_dir), device=str(self.device),
            client=f"{self.target_dir}/dp{dp}")


def _refuse_unsupported(spec: EagleSpeculator) -> None:
    """Settings whose effect needs the head's own outputs here: refused, never approximated."""
    if spec.enable_adaptive_verification:
        raise ValueError("drafter plugin: speculative_config.enable_adaptive_verification reads the head's "
                         "confidences, which stay on the drafter; turn it off or unset DRAFTER_ENDPOINTS")
    if spec.draft_watermarker is not None:
        raise ValueError("drafter plugin: watermark_config samples drafts with the watermark on the target; "
                         "remote drafting does not support it (unset DRAFTER_ENDPOINTS)")
    if spec.dcp_size > 1:
        raise ValueError("drafter plugin: decode_context_parallel_size > 1 is not supported with remote drafting")


def mrv2_next_token_ids(batch: int, idx_mapping: torch.Tensor, num_sampled: torch.Tensor, last_sampled: torch.Tensor,
                        next_prefill_tokens: torch.Tensor) -> torch.Tensor:
    """Each request's next token, as MRv2's draft prefill picks it: [batch] int64.

    idx_mapping: [>= batch] request-state slot of each row; num_sampled: [>= batch] tokens sampled this
    step (0 while a chunked prefill is still going); last_sampled: [max_num_reqs, 1] (or [max_num_reqs])
    the last sampled token per slot; next_prefill_tokens: [lookahead, max_num_reqs] (or [max_num_reqs])
    the next prompt token per slot (row 0: the one right after this chunk)."""
    idx = idx_mapping[:batch].long()
    sampled = last_sampled.reshape(last_sampled.shape[0], -1)[idx, 0].long()
    prompt = next_prefill_tokens.reshape(-1, next_prefill_tokens.shape[-1])[0, idx].long()
    return torch.where(num_sampled[:batch] > 0, sampled, prompt)


def mrv2_engine_kwargs(input_batch, next_ids: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                       last_hidden_states: torch.Tensor, aux_hidden_states, num_rejected: torch.Tensor,
                       hidden_out: torch.Tensor | None = None) -> dict:
    """MRv2's propose arguments -> DraftEngine.propose's keywords (vLLM's padded drafter batch).

    MRv2 keeps every request's whole query (rejected positions included) in the target's buffers, as
    V1's padded mode does: the drafter shifts it by one, puts next_ids at each request's last
    accepted position (query end - 1 - rejected) and samples there.
    input_batch: MRv2's InputBatch (input_ids / positions [>= num_tokens], query_start_loc
    [>= num_reqs + 1], seq_lens [>= num_reqs]); next_ids: [num_reqs]; slot_mapping: [>= num_tokens]
    (the mirrored group's layer); block_table: [>= num_reqs, max_blocks] (rows in batch order);
    last_hidden_states: [>= num_tokens, hidden]; aux_hidden_states: EAGLE-3's layers x [>= num_tokens,
    hidden] or None; num_rejected: [>= num_reqs]; hidden_out: [num_tokens, layers * hidden], the bound
    buffer's rows EAGLE-3's layers are copied into (drafter_vllm.hidden.join_layers), or None."""
    batch, num_tokens = int(input_batch.num_reqs), int(input_batch.num_tokens)
    if aux_hidden_states:
        hidden = join_layers(aux_hidden_states, num_tokens, hidden_out)  # [num_tokens, layers * hidden]
    else:
        hidden = last_hidden_states[:num_tokens]
    query_start_loc = input_batch.query_start_loc[: batch + 1]
    rejected = num_rejected[:batch]
    return dict(
        target_token_ids=input_batch.input_ids[:num_tokens], target_positions=input_batch.positions[:num_tokens],
        target_hidden_states=hidden, next_token_ids=next_ids, query_start_loc=query_start_loc,
        seq_lens=input_batch.seq_lens[:batch], block_tables=block_table[:batch],
        slot_mappings=slot_mapping[:num_tokens],
        token_indices_to_sample=(query_start_loc[1:] - 1 - rejected).to(torch.int32),
        num_rejected_tokens=rejected)
