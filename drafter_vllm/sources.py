"""Where a RemoteEagleProposer gets its drafts: one object with start / propose / close.

    source = make_source(settings, facts)
    source.start()                       # attach now, so the first step's KV reaches the drafter
    drafts = source.propose(**engine_kwargs)   # DraftEngine.propose's keywords; [batch, k] or None

`propose` returns None instead of raising, for every failure (fail closed); the proposer then
hands vLLM drafts that cannot change its output (fallback.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from drafter_vllm.settings import PluginSettings

log = logging.getLogger("vllm.drafter_vllm")  # under "vllm": shows in vLLM's log


@dataclass(frozen=True)
class TargetFacts:
    """What one vLLM worker tells the drafter about itself when it attaches."""

    method: str  # eagle | eagle3
    num_speculative_tokens: int
    hidden_size: int  # the target's hidden size (width of one hidden state)
    num_aux_layers: int  # 0: EAGLE-1's final-normed state; n: EAGLE-3's n aux states concatenated
    dtype: str  # of the hidden states, e.g. "bfloat16"
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int  # of the KV group whose block table / slot mapping the drafter mirrors
    num_blocks: int
    padded_drafter_batch: bool
    head_dir: str  # the speculative model vLLM was given (the drafter serves the same head)
    target_dir: str
    device: str  # vLLM's device (where drafts must end up)
    client: str  # for the drafter's logs, e.g. "vllm/dp0"


class DraftSource(Protocol):
    def start(self) -> bool: ...

    def propose(self, **engine_kwargs) -> torch.Tensor | None: ...

    def close(self) -> None: ...


class EngineSource:
    """The drafter's engine inside vLLM's process (DRAFTER_TRANSPORT=inprocess).

    Not for production (the head's weights land next to the target again); it checks the plugin's
    mechanics against the same engine the service runs, without a network in between."""

    def __init__(self, facts: TargetFacts):
        self.facts = facts
        self.engine = None
        self.failures = 0

    def start(self) -> bool:
        from drafter.config import EngineConfig, KVGroupSpec
        from drafter.engine import DraftEngine

        f = self.facts
        config = EngineConfig(
            method=f.method, num_speculative_tokens=f.num_speculative_tokens, max_model_len=f.max_model_len,
            max_num_seqs=f.max_num_seqs, max_num_batched_tokens=f.max_num_batched_tokens,
            kv_groups=(KVGroupSpec(f.block_size, f.num_blocks),), padded_drafter_batch=f.padded_drafter_batch,
            device=f.device, dtype=f.dtype)
        self.engine = DraftEngine.from_dirs(f.head_dir, f.target_dir, config)
        return True

    def propose(self, **engine_kwargs) -> torch.Tensor | None:
        try:
            if self.engine is None:
                self.start()
            return self.engine.propose(**engine_kwargs).draft_token_ids
        except Exception as exc:  # noqa: BLE001 - fail closed on anything, the target must go on
            self.failures += 1
            if self.failures == 1:
                log.warning("drafter plugin: in-process drafter failed (%s); steps go without drafts", exc)
            return None

    def close(self) -> None:
        self.engine = None


def make_source(settings: PluginSettings, facts: TargetFacts) -> DraftSource:
    if settings.transport == "inprocess":
        return EngineSource(facts)
    raise NotImplementedError(
        f"drafter plugin: transport {settings.transport!r} needs the drafter service clients "
        "(coordinator/), which this build does not have yet")
