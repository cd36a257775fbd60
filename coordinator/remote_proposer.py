"""The target-side drafter client: DraftEngine.propose's call shape, failing closed.

    proposer = RemoteProposer(spec, router=Router(StaticEndpoints([...])), key="target/dp0",
                              connect=make_transport)
    drafts = proposer.propose(target_token_ids=..., ..., num_rejected_tokens=...)  # [batch, k] or None
    drafts = proposer.request_drafts(request)   # the same from a drafter.wire.records.ProposeRequest

None means "no drafts this step": the target decodes normally, and its output cannot change.
Guarantees:
  * a deadline per call: attach and propose of one step share one budget (`deadline_s`), so a
    step waits at most that long for the drafter, never more (plus Python's own overhead);
  * fail closed on anything: timeout, refusal, a dead drafter, a malformed answer, a bug;
  * per-endpoint circuit breakers (circuit.py): after repeated failures calls stop for a backoff
    that doubles (with jitter) until a trial call succeeds; the trial is also the reconnect;
  * re-attach by itself when the session is lost (FAILED_PRECONDITION: the drafter restarted and
    its epoch changed; NOT_FOUND: it forgot the session).  `generation` counts attached sessions;
    a step during which the session changed returns None, so the caller sees the new generation
    before it sends anything that assumed the old session's KV (drafting.py then resends the
    context);
  * routing (routing.py): the session lives on the key's preferred endpoint; with fail-over on,
    an endpoint whose breaker is open is skipped for the next in the key's ranking, and the
    session moves back once the preferred one answers again (the mapping stays stable);
  * the previous step's rejected counts travel in every call (num_rejected_tokens), so the
    drafter knows its own acceptance.
Over ZMQ the session is bound where the drafter can serve a bound session (ProposerConfig.bound,
coordinator/transport/bound_transport.py): the transport owns ring-backed buffers, copies each
step's tensors into them (one copy per tensor) and ships the ring; what does not fit a binding
goes by the unbound Propose.  Unbound, tensors go to the transport as they are (CPU tensors are
framed without copies by the network clients; with `connect=functools.partial(ServiceTransport,
share_cuda=True)` and bound mode "off", CUDA hidden states go as CUDA IPC references to a drafter
on the same host that accepts them: see coordinator/transport/cuda_share.py); drafts come back on
the device of next_token_ids.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from coordinator.circuit import BreakerConfig, CircuitBreaker, State
from coordinator.routing import Endpoint, Router
from coordinator.session import (INVALID_ARGUMENT, SESSION_LOST, DraftTransport, SessionInfo, SessionSpec,
                                 code_name)
from coordinator.transport.bound_transport import BoundConfig, bindable
from drafter.wire.records import ProposeRequest

log = logging.getLogger("coordinator.proposer")


@dataclass(frozen=True)
class ProposerConfig:
    deadline_s: float = 0.5  # one step's whole budget for the drafter (attach + propose)
    breaker: BreakerConfig = BreakerConfig()
    failover: bool = True  # try the key's next endpoint while the preferred one is open
    # events kept (the most recent): every step of an outage logs one, and a target runs for
    # days; the per-reason counts of no-draft steps are in ProposerStats, whole
    max_events: int = 4096
    # ZMQ drafters: a bound session where the drafter can serve one (coordinator.transport.bound_transport);
    # BoundConfig(mode="off") keeps every step on the unbound Propose
    bound: BoundConfig = BoundConfig()


@dataclass(frozen=True)
class Event:
    """One fail-closed step or session change, for logs and the demo's report."""

    t: float  # seconds since the proposer started
    kind: str  # no_drafts | attached | session_lost | circuit | moved
    endpoint: str
    detail: str
    wait_s: float = 0.0


@dataclass
class ProposerStats:
    calls: int = 0
    drafted: int = 0  # calls that returned drafts
    no_drafts: dict = field(default_factory=dict)  # reason -> count
    latencies: dict = field(default_factory=dict)  # transport name -> seconds of successful calls
    max_wait_s: float = 0.0  # the longest any call made its caller wait
    late: int = 0  # answers that came after the deadline (the transport overran its timeout)


class RemoteProposer:
    def __init__(self, spec: SessionSpec, *, router: Router, key: str,
                 connect: Callable[[Endpoint], DraftTransport], config: ProposerConfig = ProposerConfig(),
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None):
        self.spec = spec
        self.router = router
        self.key = key
        self.connect = connect
        self.cfg = config
        self.clock = clock
        self.rng = rng or random.Random(hash(key) & 0xFFFF)
        self.t0 = clock()
        self.breakers: dict[Endpoint, CircuitBreaker] = {}
        self.transports: dict[Endpoint, DraftTransport] = {}
        self.endpoint: Endpoint | None = None
        self.session: SessionInfo | None = None
        self.generation = 0  # sessions attached so far; changes whenever the drafter-side KV is new
        self.last_batch_padded: int | None = None
        self.events: deque[Event] = deque(maxlen=config.max_events)
        self.stats = ProposerStats()

    # ---------------------------------------------------------------- bookkeeping
    def _event(self, kind: str, endpoint, detail: str, wait: float = 0.0) -> None:
        ev = Event(self.clock() - self.t0, kind, str(endpoint), detail, wait)
        self.events.append(ev)
        if kind != "no_drafts":  # session events are rare; per-step misses are counted, not logged
            log.info("%s %s %s %s", self.key, kind, endpoint, detail)

    def _no_drafts(self, reason: str, endpoint, detail: str, started: float) -> None:
        wait = self.clock() - started
        self.stats.no_drafts[reason] = self.stats.no_drafts.get(reason, 0) + 1
        self._event("no_drafts", endpoint, f"{reason}: {detail}" if detail else reason, wait)

    def _breaker(self, ep: Endpoint) -> CircuitBreaker:
        if ep not in self.breakers:
            def changed(old: State, new: State, ep=ep):
                self._event("circuit", ep, f"{old.value} -> {new.value}")
            self.breakers[ep] = CircuitBreaker(self.cfg.breaker, clock=self.clock, rng=self.rng, on_change=changed)
        return self.breakers[ep]

    def _transport(self, ep: Endpoint) -> DraftTransport:
        if ep not in self.transports:
            self.transports[ep] = bindable(self.connect(ep), self.spec, self.cfg.bound)
        return self.transports[ep]

    def _drop_transport(self, ep: Endpoint) -> None:
        """Reconnect from scratch next time: a fresh socket carries no stale replies."""
        transport = self.transports.pop(ep, None)
        if transport is not None:
            try:
                transport.close()
            except Exception:  # closing a broken connection must not fail the step
                log.debug("closing %s failed", ep, exc_info=True)

    def _choose(self) -> Endpoint | None:
        ranked = self.router.rank(self.key)
        if not ranked:
            return None
        if not self.cfg.failover:
            return ranked[0]
        for ep in ranked:
            if self._breaker(ep).ready():
                return ep
        return ranked[0]  # all open: stay with the preferred one (its breaker says no)

    def _move_to(self, ep: Endpoint | None) -> None:
        if ep == self.endpoint:
            return
        if self.endpoint is not None:
            self._event("moved", self.endpoint, f"-> {ep}")
        self.endpoint = ep
        self.session = None  # the session (and its KV) stays behind; a new one is attached

    # ---------------------------------------------------------------- session
    def _attach(self, ep: Endpoint, deadline_at: float) -> bool:
        remaining = deadline_at - self.clock()
        if remaining <= 0:
            return False
        self.session = self._transport(ep).attach(self.spec, timeout=remaining)
        self.generation += 1
        self._event("attached", ep, f"session {self.session.session_id} epoch {self.session.epoch} "
                                    f"generation {self.generation}")
        return True

    def start(self) -> bool:
        """Attach eagerly (optional: propose attaches lazily); False if the drafter was not reachable."""
        started = self.clock()
        ep = self._choose()
        self._move_to(ep)
        if ep is None or not self._breaker(ep).allow():
            return False
        try:
            ok = self._attach(ep, started + self.cfg.deadline_s)
        except Exception as e:  # noqa: BLE001 - fail closed on anything
            self._log_refusal(ep, e)
            self._failure(ep, e, started, prefix="attach ")
            return False
        if ok:
            self._breaker(ep).record_success()
        return ok

    def close(self, timeout: float = 0.2) -> None:
        if self.session is not None and self.endpoint in self.transports:
            try:
                self.transports[self.endpoint].detach(self.session, timeout=timeout)
            except Exception:  # best effort: the drafter may be gone already
                log.debug("detach from %s failed", self.endpoint, exc_info=True)
        self.session = None
        for ep in list(self.transports):
            self._drop_transport(ep)

    # ---------------------------------------------------------------- the per-step call
    def propose(self, **keywords) -> torch.Tensor | None:
        """The keyword front door: DraftEngine.propose's tensors (and the service's options, see
        ProposeRequest.from_keywords) -> request_drafts."""
        return self.request_drafts(ProposeRequest.from_keywords(**keywords))

    def request_drafts(self, request: ProposeRequest) -> torch.Tensor | None:
        """One step's drafts [batch, k] int64 on the caller's device, or None (fail closed)."""
        started = self.clock()
        self.stats.calls += 1
        self.last_batch_padded = None
        try:
            return self._request_drafts(started, request)
        finally:
            self.stats.max_wait_s = max(self.stats.max_wait_s, self.clock() - started)

    def _request_drafts(self, started: float, request: ProposeRequest) -> torch.Tensor | None:
        deadline_at = started + self.cfg.deadline_s
        try:
            ep = self._choose()
        except Exception as e:  # noqa: BLE001 - a resolver bug must not stop the target
            self._no_drafts("routing", None, repr(e), started)
            return None
        self._move_to(ep)
        if ep is None:
            self._no_drafts("no_endpoint", None, "", started)
            return None
        if not self._breaker(ep).allow():
            self._no_drafts("circuit_open", ep, "", started)
            return None
        if self.session is None:
            # a new session has no KV yet: this step gets no drafts, the caller resends context
            self._attach_in_step(ep, deadline_at, started, "attached")
            return None
        try:
            out = self._transport(ep).request_drafts(self.session, request, max(1e-3, deadline_at - self.clock()))
        except Exception as e:  # noqa: BLE001 - refusals, transport failures, timeouts, bugs: all fail closed
            code = code_name(e)
            if code in SESSION_LOST and hasattr(e, "message"):
                # the drafter is alive but lost our session (restart: new epoch, or it forgot us):
                # attach again within what is left of this step's budget
                self._event("session_lost", ep, f"{code}: {e.message}")
                self.session = None
                self._attach_in_step(ep, deadline_at, started, "session_lost")
            elif code == INVALID_ARGUMENT and hasattr(e, "message"):
                # our request was wrong, the drafter is fine: do not trip its breaker, say so loudly
                log.error("%s: drafter refused input field %r: %s", self.key, getattr(e, "field", ""), e.message)
                self._no_drafts("invalid_argument", ep, f"{getattr(e, 'field', '')}: {e.message}", started)
            else:
                self._failure(ep, e, started)
            return None
        drafts = getattr(out, "draft_token_ids", out)
        batch = request.batch_size
        if not isinstance(drafts, torch.Tensor) or drafts.dim() != 2 or drafts.shape[0] != batch or \
                drafts.shape[1] != self.spec.num_speculative_tokens:
            self._breaker(ep).record_failure()
            self._no_drafts("malformed", ep, f"drafts of shape {getattr(drafts, 'shape', None)}", started)
            return None
        if self.clock() > deadline_at:
            self.stats.late += 1  # the transport overran its timeout; the answer is still valid
        self._breaker(ep).record_success()
        self.stats.drafted += 1
        self.stats.latencies.setdefault(self._transport(ep).name, []).append(self.clock() - started)
        self.last_batch_padded = getattr(out, "batch_padded", None) or None  # 0: the drafter did not say
        return drafts.to(request.inputs.next_token_ids.device, torch.int64)

    def _attach_in_step(self, ep: Endpoint, deadline_at: float, started: float, reason: str) -> None:
        """Attach a session as part of a step that returns no drafts."""
        try:
            attached = self._attach(ep, deadline_at)
        except Exception as e:  # noqa: BLE001
            self._log_refusal(ep, e)
            self._failure(ep, e, started, prefix="attach ")
            return
        if attached:
            self._breaker(ep).record_success()
            self._no_drafts(reason, ep, "", started)
        else:  # no time left in this step's budget: attach on the next one
            self._no_drafts(reason, ep, "no time left to attach", started)

    def _log_refusal(self, ep: Endpoint, e: Exception) -> None:
        if code_name(e) in ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"):
            # a refusal of our layout (or a full drafter) is configuration, not an outage
            log.error("%s: %s refused the session (%s): %s", self.key, ep, code_name(e), error_detail(e))

    def _failure(self, ep: Endpoint | None, e: Exception, started: float, prefix: str = "") -> None:
        if ep is not None:
            self._breaker(ep).record_failure()
            self._drop_transport(ep)
        self._no_drafts(prefix + code_name(e), ep, error_detail(e), started)


# An attach refusal lists every mismatch (a few hundred characters); longer texts are cut.
_DETAIL_CHARS = 1000


def error_detail(e: Exception) -> str:
    """An error's text without its status code (the reason in front of it already names the code once):
    "max_model_len: the target has 4096, ..." rather than "FAILED_PRECONDITION max_model_len: ..."."""
    message = getattr(e, "message", None)
    if message is None:
        return str(e)[:_DETAIL_CHARS]
    field = getattr(e, "field", "") or ""
    # several fields (an attach refusal listing every mismatch) are named inside the message already
    text = f"{field}: {message}" if field and "," not in field else message
    return text[:_DETAIL_CHARS]
