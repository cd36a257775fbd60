"""Where a RemoteEagleProposer gets its drafts: one object with start / propose / close.

    source = make_source(settings, facts)
    source.start()                       # attach now, so the first step's KV reaches the drafter
    drafts = source.propose(**engine_kwargs)   # DraftEngine.propose's keywords; [batch, k] or None

`propose` returns None instead of raising, for every failure (fail closed); the proposer then
hands vLLM drafts that cannot change its output (fallback.py).
"""

from __future__ import annotations

import logging
import time
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
        self.broken: Exception | None = None  # a head that does not load will not load next step either
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
        if self.broken is not None:
            return None
        try:
            if self.engine is None:
                try:
                    self.start()
                except Exception as exc:  # noqa: BLE001
                    self.broken = exc
                    raise
            return self.engine.propose(**engine_kwargs).draft_token_ids
        except Exception as exc:  # noqa: BLE001 - fail closed on anything, the target must go on
            self.failures += 1
            if self.failures == 1:
                log.warning("drafter plugin: in-process drafter failed (%s); steps go without drafts", exc)
            return None

    def close(self) -> None:
        self.engine = None


class ServiceSource:
    """`drafter serve` over ZMQ or gRPC (coordinator/transport), failing closed.

    One step's whole budget (attach included) is the deadline.  After a failure the connection is
    rebuilt from scratch, and calls pause for a backoff that doubles (0.1 s .. 5 s) until one
    succeeds, so a dead drafter costs at most one deadline per backoff, not one per step.  A
    drafter that restarted (NOT_FOUND / FAILED_PRECONDITION: our session or epoch is gone) is
    re-attached at once, within the same step's budget."""

    BACKOFF_S = (0.1, 5.0)

    def __init__(self, settings: PluginSettings, facts: TargetFacts, clock=time.monotonic):
        self.settings = settings
        self.facts = facts
        self.endpoint = settings.endpoints[0]
        self.clock = clock
        self.client = None
        self.session = None  # the AttachResponse: kept across reconnects (the drafter keeps our KV)
        self.paused_until = 0.0
        self.backoff = 0.0
        self.epoch = None
        self.failures = 0
        self.last_error = ""
        self.attaches = 0  # sessions attached so far (more than one: the drafter restarted)

    def layout(self) -> dict:
        f = self.facts
        return {"protocol_version": 1, "method": f.method, "num_speculative_tokens": f.num_speculative_tokens,
                "hidden_dtype": f.dtype, "hidden_size": f.hidden_size, "num_aux_layers": f.num_aux_layers,
                "max_model_len": f.max_model_len, "max_num_seqs": f.max_num_seqs,
                "max_num_batched_tokens": f.max_num_batched_tokens,
                "kv_groups": [{"block_size": f.block_size, "num_blocks": f.num_blocks}], "client_name": f.client}

    def _connect(self):
        if self.settings.transport == "zmq":
            from coordinator.transport import ZmqDrafterClient

            return ZmqDrafterClient(self.endpoint, timeout_s=self.settings.deadline_s)
        from coordinator.transport import GrpcDrafterClient

        return GrpcDrafterClient(self.endpoint, timeout_s=self.settings.deadline_s)

    def _client(self):
        if self.client is None:
            self.client = self._connect()
            if self.session is not None:
                self.client.session.set(self.session)  # same session over the new connection
        return self.client

    def _attach(self, deadline_at: float) -> None:
        self.session = None
        resp = self._client().attach(self.layout(), timeout=max(1e-3, deadline_at - self.clock()))
        if self.epoch is not None and resp.epoch != self.epoch:
            log.warning("drafter plugin: drafter at %s restarted (epoch %s -> %s): its KV starts empty, "
                        "drafts for running requests are weaker until they finish", self.endpoint, self.epoch,
                        resp.epoch)
        self.epoch, self.session = resp.epoch, resp
        self.attaches += 1
        log.info("drafter plugin: attached to %s (%s), session %s, epoch %s", self.endpoint,
                 self.settings.transport, resp.session_id[:8], resp.epoch)

    def start(self) -> bool:
        try:
            self._attach(self.clock() + self.settings.deadline_s)
            return True
        except Exception as exc:  # noqa: BLE001 - propose retries
            self._failed(exc)
            return False

    def propose(self, **engine_kwargs) -> torch.Tensor | None:
        from drafter.service.errors import Code, DrafterError

        now = self.clock()
        if now < self.paused_until:
            return None
        deadline_at = now + self.settings.deadline_s
        for attempt in (0, 1):
            try:
                if self.session is None:
                    self._attach(deadline_at)
                out = self._client().propose(timeout=max(1e-3, deadline_at - self.clock()), **engine_kwargs)
            except DrafterError as exc:
                if exc.code in (Code.NOT_FOUND, Code.FAILED_PRECONDITION) and attempt == 0 and self.session:
                    self.session = None  # the drafter forgot us (restart): attach again, same budget
                    continue
                self._failed(exc)
                return None
            except Exception as exc:  # noqa: BLE001 - fail closed on anything, the target must go on
                self._failed(exc)
                return None
            self.backoff, self.failures, self.last_error = 0.0, 0, ""
            return out.draft_token_ids
        return None

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        lo, hi = self.BACKOFF_S
        self.backoff = min(hi, self.backoff * 2) if self.backoff else lo
        self.paused_until = self.clock() + self.backoff
        what = f"{getattr(exc, 'code', type(exc).__name__)} {getattr(exc, 'field', '')}"
        if what != self.last_error:
            # once per kind of failure, not per step: a refused layout names its field here
            log.warning("drafter plugin: %s at %s failed (%s); retrying with backoff up to %.0f s",
                        self.settings.transport, self.endpoint, exc, hi)
            self.last_error = what
        # a fresh connection next time (no stale replies, no half-open socket), same session
        self._drop_client()

    def _drop_client(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken connection must not fail the step
                pass

    def close(self) -> None:
        if self.session is not None:
            try:
                self._client().detach(timeout=0.2)
            except Exception:  # noqa: BLE001 - best effort: the drafter may be gone
                pass
            self.session = None
        self._drop_client()


def check_transport(settings: PluginSettings) -> None:
    """At engine start: a transport whose client cannot even be imported is a set-up error, not a
    drafter outage, so it stops vLLM with a clear message instead of failing closed forever."""
    if settings.transport == "inprocess":
        import drafter.engine  # noqa: F401
        return
    try:
        import coordinator.transport  # noqa: F401
        import drafter.service.errors  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"drafter plugin: the {settings.transport} client cannot be imported ({exc}); "
                           "install the plugin with pip install 'drafter[vllm]'") from exc


def make_source(settings: PluginSettings, facts: TargetFacts) -> DraftSource:
    if settings.transport == "inprocess":
        return EngineSource(facts)
    return ServiceSource(settings, facts)
