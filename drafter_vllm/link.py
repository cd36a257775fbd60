"""One vLLM worker's link to its drafter, shared by both stand-ins (V1's proposer, Model Runner V2's
speculator): TP rank 0 asks, every TP rank gets the same [batch, k] drafts, and anything that goes
wrong turns into fallback drafts (fallback.py) without stopping vLLM.

    link = DrafterLink(settings, vocab_size=..., device=..., facts=lambda width: TargetFacts(...))
    drafts = link.step(k, batch, next_ids, make_kwargs)   # [batch, k] int64 on vLLM's device

`make_kwargs()` returns DraftEngine.propose's keywords cut to this step's rows (called on TP rank 0
only, inside the fail-closed guard); `facts` is called once, at the first step (it needs the width of
the hidden states vLLM actually passes).
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable

import torch

from drafter_vllm.fallback import fallback_drafts, usable_drafts
from drafter_vllm.settings import PluginSettings
from drafter_vllm.sources import TargetFacts, make_source, serve_flags

log = logging.getLogger("vllm.drafter_vllm")  # under "vllm": shows in vLLM's log

class DrafterLink:
    def __init__(self, settings: PluginSettings, *, vocab_size: int, device, facts: Callable[[int], TargetFacts]):
        self.settings = settings
        self.vocab_size = vocab_size
        self.device = device
        self._facts = facts
        self.source = None  # built by TP rank 0 at its first step (needs the hidden width)
        self.stats = {"calls": 0, "drafted": 0, "fallback": 0}
        self._last_failure: str | None = None
        self._outage_steps = 0  # steps without drafts since drafting last worked

    def step(self, k: int, batch: int, next_ids: torch.Tensor, make_kwargs: Callable[[], dict]) -> torch.Tensor:
        """Rank 0 asks the drafter, the other TP ranks receive its answer: [batch, k] int64.

        next_ids: [batch] int, each request's next token (what fallback drafts repeat)."""
        from vllm.distributed import get_tp_group

        tp = get_tp_group()
        if tp.rank_in_group == 0:
            drafts = self.ask(k, batch, next_ids, make_kwargs)
        else:
            drafts = torch.empty((batch, k), dtype=torch.int64, device=self.device)
        if tp.world_size > 1:
            # one rank asked; every rank of the group must verify the same drafts
            drafts = tp.broadcast(drafts, src=0)
        return drafts

    def ask(self, k: int, batch: int, next_ids: torch.Tensor, make_kwargs: Callable[[], dict]) -> torch.Tensor:
        """One call to the drafter, failing closed: [batch, k] int64 on vLLM's device."""
        self.stats["calls"] += 1
        drafts, why = None, None
        try:
            kwargs = make_kwargs()
            if not self.settings.copies_inputs:
                # a network call may still hold these buffers after it gave up (a timed-out send),
                # while vLLM refills them for the next step: hand it private host copies (the bound
                # ZMQ transport copies each tensor into its ring itself: one copy, not two)
                kwargs = {n: None if t is None else t.detach().to("cpu", copy=True) for n, t in kwargs.items()}
            source = self._source(int(kwargs["target_hidden_states"].shape[-1]))
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
            log.info("drafter plugin: attaching as %s", facts.client)
            self.source = make_source(self.settings, facts)
            # attach before the first call, so that the first step's KV (the prompts) reaches it
            try:
                self.source.start()
            except Exception as exc:  # noqa: BLE001 - propose retries (and fails closed) by itself
                log.warning("drafter plugin: attaching failed (%r); will retry", exc)
            weakref.finalize(self, _close_quietly, self.source)
        return self.source


def log_serve_flags(facts: TargetFacts) -> None:
    """At engine start, once vLLM sized its KV cache: the `drafter serve` flags that match this engine
    (TP rank 0 only: the ranks of one TP group share one session)."""
    from vllm.distributed import get_tp_group

    if get_tp_group().rank_in_group == 0:
        log.info("drafter plugin: %s; `drafter serve` flags that match this engine: %s", facts.client,
                 serve_flags(facts))


def _last_no_drafts_reason(source) -> str:
    # the proposer's events are a bounded deque (ProposerConfig.max_events): reading the last is all
    events = getattr(source, "events", None)
    if not events:
        return "no drafts from the drafter"
    return f"no drafts ({events[-1].detail})"


def _close_quietly(source) -> None:
    try:
        source.close()
    except Exception:  # noqa: BLE001 - interpreter shutdown: best effort
        pass
