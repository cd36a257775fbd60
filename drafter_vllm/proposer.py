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
import weakref

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.spec_decode.eagle import EagleProposer

from drafter_vllm.fallback import fallback_drafts, usable_drafts
from drafter_vllm.settings import PluginSettings
from drafter_vllm.sources import TargetFacts, check_transport, make_source

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
        self.source = None  # built by TP rank 0 at its first propose (needs the hidden width)
        self.stats = {"calls": 0, "drafted": 0, "fallback": 0}
        self._last_failure = None
        self._outage_steps = 0  # steps without drafts since drafting last worked
        if self.speculative_config.draft_sample_method == "probabilistic":
            log.warning("drafter plugin: the drafter proposes greedy drafts; draft_sample_method="
                        "'probabilistic' is ignored (verification stays lossless)")
        log.info("drafter plugin: %s drafting for %s goes to %s over %s (deadline %.0f ms); the head "
                 "is not loaded here", self.method, self.target_dir, ",".join(self.settings.endpoints) or "-",
                 self.settings.transport, self.settings.deadline_ms)

    # ------------------------------------------------------------------ set-up hooks
    def load_model(self, target_model) -> None:
        self._draft_attn_layer_names = set()
        # the drafter sees token ids and hidden states only; multimodal embeddings stay here
        self.supports_mm_inputs = False

    def validate_same_kv_cache_group(self, kv_cache_config) -> None:
        return None

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        gid = _mirrored_group(kv_cache_config)
        spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
        kernel = spec.block_size
        if kernel_block_sizes is not None and gid < len(kernel_block_sizes) and kernel_block_sizes[gid]:
            # block tables and slot mappings are written in kernel blocks when they differ
            kernel = int(kernel_block_sizes[gid])
        self.kv_cache_gid = gid
        self.block_size = kernel
        self.num_kv_blocks = int(kv_cache_config.num_blocks) * (spec.block_size // kernel)
        self.draft_attn_groups = []

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
        from vllm.distributed import get_tp_group

        tp = get_tp_group()
        if tp.rank_in_group == 0:
            drafts = self._ask_drafter(k, batch, target_token_ids, target_positions, target_hidden_states,
                                       next_token_ids, token_indices_to_sample, cad, num_rejected_tokens_gpu)
        else:
            drafts = torch.empty((batch, k), dtype=torch.int64, device=self.device)
        if tp.world_size > 1:
            # one rank asked; every rank of the group must verify the same drafts
            drafts = tp.broadcast(drafts, src=0)
        return drafts

    def _ask_drafter(self, k, batch, token_ids, positions, hidden, next_token_ids, sample_idx, cad,
                     num_rejected) -> torch.Tensor:
        self.stats["calls"] += 1
        next_ids = next_token_ids[:batch]
        drafts, why = None, None
        try:
            num_tokens = int(cad.num_actual_tokens)
            kwargs = dict(
                target_token_ids=token_ids[:num_tokens], target_positions=positions[:num_tokens],
                target_hidden_states=hidden[:num_tokens], next_token_ids=next_ids,
                query_start_loc=cad.query_start_loc[: batch + 1], seq_lens=cad.seq_lens[:batch],
                block_tables=cad.block_table_tensor[:batch], slot_mappings=cad.slot_mapping[:num_tokens],
                token_indices_to_sample=None if sample_idx is None else sample_idx[:batch],
                num_rejected_tokens=None if num_rejected is None else num_rejected[:batch])
            if self.settings.transport != "inprocess":
                # a network call may still hold these buffers after it gave up (a timed-out send),
                # while vLLM refills them for the next step: hand it private host copies
                kwargs = {n: None if t is None else t.detach().to("cpu", copy=True) for n, t in kwargs.items()}
            source = self._source(hidden.shape[-1])
            got = source.propose(**kwargs)
            if got is None:
                why = _last_no_drafts_reason(source)
            else:
                why = usable_drafts(got, batch, k, self.vocab_size)
                if why is None:
                    drafts = got[:, :k]
        except Exception as exc:  # noqa: BLE001 - a plugin bug must cost acceptance, never the target
            why = f"plugin error: {exc!r}"
            log.debug("drafter plugin: propose failed", exc_info=True)
        if drafts is None:
            self.stats["fallback"] += 1
            self._outage_steps += 1
            self._note_failure(why)
            return fallback_drafts(next_ids, k).to(self.device)
        self.stats["drafted"] += 1
        self._note_failure(None)
        return drafts.to(self.device, torch.int64)

    def _note_failure(self, why: str | None) -> None:
        """Log when drafting stops or resumes, not every step."""
        if (why is None) == (self._last_failure is None):
            return
        if why is None:
            log.info("drafter plugin: drafts resumed after %d step(s) without", self._outage_steps)
            self._outage_steps = 0
        else:
            log.warning("drafter plugin: %s; steps go on without drafts until it answers (output unchanged)",
                        why)
        self._last_failure = why

    def _source(self, hidden_width: int):
        if self.source is None:
            facts = self._facts(hidden_width)
            self.source = make_source(self.settings, facts)
            # attach before the first call, so that the first step's KV (the prompts) reaches it
            try:
                self.source.start()
            except Exception as exc:  # noqa: BLE001 - propose retries (and fails closed) by itself
                log.warning("drafter plugin: attaching failed (%r); will retry", exc)
            weakref.finalize(self, _close_quietly, self.source)
        return self.source

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


# The coordinator's proposer keeps an event per step without drafts (for reports); vLLM runs for
# weeks, possibly through a long drafter outage: keep only the recent ones.
_EVENTS_KEPT = 256


def _last_no_drafts_reason(source) -> str:
    events = getattr(source, "events", None)
    if not events:
        return "no drafts from the drafter"
    reason = f"no drafts ({events[-1].detail})"
    if len(events) > 4 * _EVENTS_KEPT:
        del events[:-_EVENTS_KEPT]
    return reason


def _mirrored_group(kv_cache_config) -> int:
    """The KV group an in-process EAGLE head would have joined: plain full attention."""
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, FullAttentionSpec) and not isinstance(spec, MLAAttentionSpec):
            return gid
    raise ValueError("drafter plugin: the target has no full-attention KV cache group for the drafter to "
                     f"mirror (groups: {[type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]})")


def _close_quietly(source) -> None:
    try:
        source.close()
    except Exception:  # noqa: BLE001 - interpreter shutdown: best effort
        pass
