"""The target side of pre-drafting: keep the pushed pre-drafts, pick locally once verification ends.

    picker = PreDraftPicker()
    picker.offer(pre)                       # whenever pre-drafts arrive (pushed, or in-process)
    hits = picker.pick(step, call_inputs, accepted_counts)   # per row: drafts [k'] or None (a miss)

`pick` reads each row's outcome (a, b) off the call the target just built (the same reading the
drafter does, drafter.wire.predraft.outcomes_of_call) and looks it up in the pre-drafts that
followed the previous draft call; nothing else is ever used.  Pre-drafts for any other call are
dropped: older ones when a pick passes them, and ones that arrive after the pick for the call
after theirs (late) at once, so a pre-draft can never serve the wrong step.  A miss drafts exactly
as without pre-drafting, and either way the call still goes to the drafter, which writes the real
KV for the accepted tokens from the target's hidden states.

PreDraftingTransport is the in-process drafter with pre-drafting on: after each draft call the
target hands it the drafts it will verify (`after`) and the engine pre-drafts for them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from coordinator.inprocess import InProcessTransport
from coordinator.session import SessionInfo, SessionSpec
from drafter.engine.engine import DraftEngine
from drafter.wire.predraft import PreDrafts, lookup, merge, outcomes_of_call, taken_frame, verifies_predrafts
from drafter.wire.records import INPUT_FIELDS, ProposeInputs, ProposeRequest


@dataclass
class PickerStats:
    picks: int = 0  # draft calls that looked for pre-drafts
    rows: dict = field(default_factory=dict)  # a -> rows whose outcome was a (rows that verified drafts)
    hits: dict = field(default_factory=dict)  # a -> of those, rows served by a pre-draft
    offered: int = 0  # pre-draft sets received
    outcomes: int = 0  # pre-drafts received (outcomes over all rows)
    rows_offered: int = 0  # rows those covered
    late: int = 0  # sets that arrived after their pick had passed: dropped
    stale: int = 0  # sets a pick passed over unused (another call's)

    @property
    def hit_rate(self) -> float:
        total = sum(self.rows.values())
        return sum(self.hits.values()) / total if total else 0.0

    def hit_rate_by_a(self) -> dict[int, float]:
        return {a: self.hits.get(a, 0) / n for a, n in sorted(self.rows.items())}

    @property
    def predrafts_per_row(self) -> float:
        return self.outcomes / self.rows_offered if self.rows_offered else 0.0


class PreDraftPicker:
    """The target's store of pushed pre-draft sets, keyed by the step (call) each one follows."""

    def __init__(self):
        self.pending: dict[int, PreDrafts] = {}
        self.floor: int | None = None  # the step of the latest pick: older pre-drafts are no use now
        self.stats = PickerStats()

    def reset(self) -> None:
        """A new drafter session: its KV, and so every pre-draft, starts over."""
        self.pending.clear()
        self.floor = None

    def offer(self, pre: PreDrafts) -> bool:
        """Keep pre-drafts for the pick of the call after theirs; False (dropped) when a pick for a
        later call has already happened: they arrived after the verification they were for."""
        if self.floor is not None and pre.step < self.floor:
            self.stats.late += 1
            return False
        self.pending[pre.step] = pre
        self.stats.offered += 1
        self.stats.outcomes += int((pre.accepted >= 0).sum())
        self.stats.rows_offered += pre.batch_size
        return True

    def has(self, step: int) -> bool:
        """Whether pre-drafts of `step` are here (and still usable)."""
        return step in self.pending

    def pick(self, step: int, inputs: ProposeInputs,
             accepted_counts: torch.Tensor | None,  # [batch] int, -1 = nothing verified
             ) -> list[torch.Tensor | None]:  # per row: [k'] int64 drafts, or None
        """Look this call's rows up in the pre-drafts of the previous draft call; every other
        pending set is dropped, and from now on only pre-drafts of `step` or later are kept."""
        pre = self.pending.pop(self.floor, None) if self.floor is not None else None
        self.stats.stale += len(self.pending)
        self.pending.clear()
        self.floor = step
        self.stats.picks += 1
        out = []
        for outcome in outcomes_of_call(inputs, accepted_counts):
            drafts = lookup(pre, outcome)
            if outcome is not None:
                self.stats.rows[outcome.accepted] = self.stats.rows.get(outcome.accepted, 0) + 1
                if drafts is not None:
                    self.stats.hits[outcome.accepted] = self.stats.hits.get(outcome.accepted, 0) + 1
            out.append(drafts)
        return out


def call_inputs(kwargs: dict) -> ProposeInputs:
    """A target's propose keywords (coordinator.target.drafting) as the record the engine reads."""
    fields = {n: kwargs.get(n) for n in INPUT_FIELDS}
    for name in ("block_tables", "slot_mappings"):
        v = fields[name]
        fields[name] = [v] if isinstance(v, torch.Tensor) else list(v)
    return ProposeInputs(**fields)


class PreDraftingTransport(InProcessTransport):
    """The in-process drafter whose sessions pre-draft `outcomes` outcomes per request, each
    `predraft_tokens` long (k'; 0 = k)."""

    name = "inprocess"

    def __init__(self, *a, outcomes: int = 4, predraft_tokens: int = 0, **kw):
        super().__init__(*a, **kw)
        self.outcomes = outcomes
        self.predraft_tokens = predraft_tokens

    def attach(self, spec: SessionSpec, timeout: float) -> SessionInfo:
        info = super().attach(spec, timeout)
        engine = self.sessions[info.session_id]
        cfg = replace(engine.config, predraft_outcomes=self.outcomes, predraft_tokens=self.predraft_tokens)
        self.sessions[info.session_id] = DraftEngine(self.head, self.head.spec, cfg)
        return info

    def engine_of(self, session: SessionInfo | None) -> DraftEngine | None:
        return None if session is None else self.sessions.get(session.session_id)


class InProcessPreDrafting:
    """Pre-drafting for a TargetEngine whose proposer talks to a PreDraftingTransport: picks with
    a PreDraftPicker, and after each call has the session's engine pre-draft for the drafts used."""

    def __init__(self, transport: PreDraftingTransport, proposer):
        self.transport = transport
        self.proposer = proposer
        self.picker = PreDraftPicker()
        self.generation = None

    def pick(self, step: int, kwargs: dict, accepted_counts) -> list[torch.Tensor | None]:
        if self.proposer.generation != self.generation:  # a new session holds none of the old KV
            self.picker.reset()
            self.generation = self.proposer.generation
        return self.picker.pick(step, call_inputs(kwargs), accepted_counts)

    def after(self, step: int, kwargs: dict, used: torch.Tensor, generation) -> None:
        """The drafter's side: pre-draft for the drafts the target will verify, then 'push'."""
        if generation != self.generation:
            self.picker.reset()
            self.generation = generation
            return
        engine = self.transport.engine_of(self.proposer.session)
        if engine is None:
            return
        self.picker.offer(engine.predraft(call_inputs(kwargs), used, step))


class PushedPreDrafting:
    """A RemoteProposer whose ZMQ drafter (`drafter serve --predraft-outcomes N`) pushes pre-drafts.

    Same call shape as the proposer (propose / request_drafts, generation, last_batch_padded).
    Each call asks for pre-drafts (want_predrafts, request_id = this wrapper's step count), reads
    what was pushed since the last call, and picks for its rows.  Every row a hit: the call goes
    out without waiting for its reply (the drafter still writes the KV and pre-drafts the next
    step) and the pre-drafts are returned at once; otherwise it waits as before and a hit's row
    gets its pre-draft.  A drafter that later answers an unawaited call with an error may lack that
    call's KV: `generation` then moves on, so the target resends every context (as after a restart).
    Pushes travel on the unbound Propose path here (a bound session's pushes: BoundPreDrafting).
    """

    def __init__(self, proposer, *, wait_on_hit: bool = False, push_wait_s: float = 0.0):
        """push_wait_s: how long a call may wait for the previous call's push before it picks (0: a
        push not here yet is a miss; a target whose verification outlasts pre-drafting waits 0)."""
        self.proposer = proposer
        self.wait_on_hit = wait_on_hit
        self.push_wait_s = push_wait_s
        self.picker = PreDraftPicker()
        self.steps = 0
        self.unawaited = 0  # calls sent without waiting (every row a hit)
        self._lost = 0  # unawaited calls the drafter failed: each is a new generation
        self._seen: int | None = None

    @property
    def generation(self) -> int:
        return self.proposer.generation + self._lost

    @property
    def last_batch_padded(self):
        return self.proposer.last_batch_padded

    @property
    def stats(self):
        return self.proposer.stats

    def start(self) -> bool:
        return self.proposer.start()

    def close(self, *a, **kw) -> None:
        self.proposer.close(*a, **kw)

    def propose(self, **keywords) -> torch.Tensor | None:
        return self.request_drafts(ProposeRequest.from_keywords(**keywords))

    def _client(self):
        """The ZMQ client under the proposer's current transport, if it has one."""
        t = self.proposer.transports.get(self.proposer.endpoint)
        client = getattr(t, "client", None) or getattr(getattr(t, "inner", None), "client", None)
        return client if hasattr(client, "poll_pushes") else None

    def _read_pushes(self, client) -> None:
        """What was pushed since the last call, waiting up to push_wait_s for the last call's set."""
        client.poll_pushes(self.push_wait_s if self.steps else 0.0, until=lambda: self.picker.has(self.steps))

    def request_drafts(self, request: ProposeRequest) -> torch.Tensor | None:  # [batch, k] int64 | None
        client = self._client()
        if client is not None:
            client.on_push = self.picker.offer
            self._read_pushes(client)
            if client.nowait_failed:
                self._lost += client.nowait_failed
                client.nowait_failed = 0
        if self.generation != self._seen:  # a new session, or KV we cannot trust: old pre-drafts are void
            self.picker.reset()
            self._seen = self.generation
        self.steps += 1
        request = replace(request, request_id=self.steps, want_predrafts=True)
        hits = self.picker.pick(self.steps, request.inputs, request.accepted_counts)
        k = self.proposer.spec.num_speculative_tokens
        if (not self.wait_on_hit and client is not None and hits and self.proposer.session is not None
                and all(h is not None and h.shape[0] >= k for h in hits) and _send_nowait(client, request)):
            self.unawaited += 1
            # every row verifies its whole pre-draft: k' drafts, deeper than k where the drafter pre-drafts so
            return merge(torch.full((len(hits), k), -1, dtype=torch.long), hits)[0].to(
                request.inputs.next_token_ids.device)
        exact = self.proposer.request_drafts(request)
        if exact is None:
            return None
        used, _ = merge(exact, hits)
        return used


def _send_nowait(client, request: ProposeRequest) -> bool:
    """client.send_nowait, False on any failure (the call then goes the awaited way)."""
    try:
        return client.send_nowait(request)
    except Exception:  # noqa: BLE001 - e.g. no session on this client yet
        return False


class BoundPreDrafting:
    """Pushed pre-drafts on a bound session (coordinator.transport.bound_ipc.CudaIpcBoundClient,
    cuda_ipc; the drafter serving --predraft-outcomes).

        pd = BoundPreDrafting(client)
        drafts, hit = pd.step(inputs, accepted_counts)   # inputs: the call on the host, the client's block ids

    Each step asks for pre-drafts (StepHeader.want_predrafts) keyed by the binding's step number;
    the drafter pushes each set on the binding's channel after the StepDone, and the client reads
    pushes while it waits for a StepDone and here before each pick (up to push_wait_s for the last
    step's set).  The pick reads each row's outcome off the call (outcomes_of_call) and looks it
    up in the set of the step before, never any other (PreDraftPicker: older sets dropped, a late
    one dropped on arrival, all of them on a new binding).  Every row a hit (or, with min_hits,
    enough of them: drafter.wire.predraft.verifies_predrafts): the step goes out without waiting
    (step_nowait: the drafter writes the step's KV and pushes the next set) and the pre-drafts
    are returned, no round trip; otherwise the exact step, its exact drafts in every row (the
    drafter applies the same rule to the same picks).  The views are written here
    (coordinator.transport.bound_transport.fill) after settle(), which orders them after the
    drafter's reads of an unawaited step."""

    def __init__(self, client, push_wait_s: float = 0.0, wait_on_hit: bool = False, min_hits: float | None = None,
                 signal_taken: bool = True):
        """min_hits: also send without waiting when at least this share of the rows hit (at least
        one); the rows that missed then get -1 drafts (verify none this step: one token).  None:
        only when every row hits.  signal_taken: after an awaited step, tell the drafter on the
        doorbell that its drafts are here (drafter.wire.predraft.TAKEN): its pre-draft's GPU work
        then starts only after this side's read of the step's output, never beside it."""
        self.client, self.push_wait_s, self.wait_on_hit = client, push_wait_s, wait_on_hit
        self.signal_taken = signal_taken
        self.min_hits = min_hits
        self.picker = PreDraftPicker()
        client.on_push = self.picker.offer
        self.unawaited = 0  # steps sent without waiting (every row a hit)
        self._link = None
        # the last step's perf_counter_ns on this side (the bench's stage split): "polled" (pushes read),
        # "picked", "settled" (an unawaited step's StepDone and event), "filled" (the views written),
        # "sent" (an unawaited step's header out; an awaited step's own stamps are the client's)
        self.stamps: dict[str, int] = {}

    @property
    def min_hits(self) -> float | None:
        return self._min_hits

    @min_hits.setter
    def min_hits(self, share: float | None) -> None:
        """The rule's share, told to the drafter in every step's header (StepHeader.predraft_min_hits)."""
        self._min_hits = share
        self.client.predraft_min_hits = share or 0.0

    def step(self, inputs: ProposeInputs, accepted_counts: torch.Tensor | None,  # [batch] int, -1: none
             batch_padded: int = 0, tokens_padded: int = 0) -> tuple[torch.Tensor, list[bool]]:
        """([batch, k] int64 drafts on the host, per row whether it is a pre-draft; [batch, k'] when
        the step went without waiting on pre-drafts deeper than k, -1 where a row verifies none)."""
        from coordinator.transport.bound_transport import fill

        client = self.client
        if client.link is None or client.link is not self._link:
            self.picker.reset()  # a new binding: its steps count from 1, its KV starts over
            self._link = client.link
        last = client.last_step
        clock = time.perf_counter_ns
        stamps = self.stamps = {}
        if last:
            client.poll_pushes(self.push_wait_s, until=lambda: self.picker.has(last))
            client.poll_pushes(0.0)
        stamps["polled"] = clock()
        step = last + 1
        hits = self.picker.pick(step, inputs, accepted_counts)
        counts = None if accepted_counts is None else [int(a) for a in accepted_counts.tolist()]
        stamps["picked"] = clock()
        client.settle()
        stamps["settled"] = clock()
        n, b = fill(client.views, inputs)
        stamps["filled"] = clock()
        k = client.width or max((int(h.shape[0]) for h in hits if h is not None), default=1)
        hits = [h if h is not None and h.shape[0] >= k else None for h in hits]
        got = [h is not None for h in hits]
        width = max([k] + [int(h.shape[0]) for h in hits if h is not None])  # k' > k: hits verify all k'
        min_hits = self.min_hits or 0.0
        if (not self.wait_on_hit and client.link is self._link and self._link is not None
                and verifies_predrafts(hits, min_hits)):
            client.step_nowait(n, b, batch_padded, tokens_padded, counts)
            stamps["sent"] = clock()
            self.unawaited += 1
            drafts = torch.full((b, width), -1, dtype=torch.long)
            for r, h in enumerate(hits):
                if got[r]:
                    drafts[r, : h.shape[0]] = h
            return drafts, got
        exact = client.step(n, b, batch_padded, tokens_padded, counts, want_predrafts=True)
        if self.signal_taken:
            self._taken(client.last_step)
        if client.link is not self._link:  # bound during the step: the picks were for no binding;
            self.picker.reset()  # the next pick reads this step's set (the new binding's first)
            self.picker.floor, self._link = client.last_step, client.link
        return exact, [False] * b  # the step waited: its exact drafts in every row (verifies_predrafts)

    def _taken(self, step: int) -> None:
        """TAKEN for `step` on the binding's doorbell (none without one: the data socket's steps
        keep the drafter's pre-draft starting at once); a failed send is left to the next step's."""
        bell = getattr(self.client.link, "bell", None)
        if bell is None:
            return
        try:
            bell.send(taken_frame(step))
        except OSError:
            return
        self.stamps["taken"] = time.perf_counter_ns()
