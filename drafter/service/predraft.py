"""Pre-drafting in the service: after a batch's replies have left, the engine thread pre-drafts
for each call that asked (ProposeRequest.want_predrafts, `--predraft-outcomes` > 0) and pushes the
result on the call's connection (drafter.wire.predraft, docs/predraft.md).

The pre-drafts are conditioned on the drafts the target will verify: on a hit, the target verifies
the previous pre-draft instead of this call's exact drafts, and this side finds the same hit from
the same pushed set (outcomes_of_call + lookup), so both ends agree without another message.
Pre-drafting never fails a call: its errors are logged.  A call that asked and gets no
pre-drafts (budget 0, requests waiting, an error) gets a set without outcomes (`nothing`), so a
target that waits for each call's set (PushedPreDrafting's push_wait_s) never waits in vain.

The budget adapts per session (`Budget`; --predraft-outcomes is its most).  A pushed set the
target had in time shows in the next call but one: a row this side counted a hit was verified with
the pre-draft's tokens.  A row counted a hit whose verified drafts were the exact ones instead
means the set reached the target after it had picked (late): the budget halves, and a session at
0 gets no pre-drafts (exact drafts, an empty set pushed) except one probe of 1 outcome every
`probe_every` calls.  Sets in time grow it by one per call up to the most.  While a request waits
for the engine no pre-draft is made at all (exact drafting is never delayed by it) and the
session's budget halves too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable

import torch

from drafter.service.sessions import offset_inputs
from drafter.wire.predraft import PreDrafts, lookup, merge, outcomes_of_call

log = logging.getLogger("drafter.service.predraft")


def nothing(step: int, shape) -> PreDrafts:
    """A pushed set without outcomes ("none this time") for a call whose drafts were `shape`
    [batch, k]: block and position -1, which no call's row has, so every lookup misses."""
    batch, k = int(shape[0]), int(shape[1])
    none = torch.full((batch,), -1, dtype=torch.long)
    return PreDrafts(step, none, none.clone(), torch.full((batch, k), -1, dtype=torch.long),
                     accepted=torch.full((batch, 1), -1, dtype=torch.long),
                     next_tokens=torch.full((batch, 1), -1, dtype=torch.long),
                     drafts=torch.full((batch, 1, 1), -1, dtype=torch.long))


@dataclass
class Budget:
    """One session's outcomes per request for its next pre-draft (module docstring)."""

    most: int  # --predraft-outcomes
    probe_every: int = 8
    outcomes: int = 0
    idle: int = 0  # calls at 0 since the last probe

    def __post_init__(self):
        self.outcomes = self.most

    def late(self) -> None:
        self.outcomes //= 2

    def in_time(self) -> None:
        self.outcomes = min(self.most, self.outcomes + 1)

    def take(self) -> int:
        """The budget for this call's pre-draft; 0 = none (a probe of 1 every probe_every calls)."""
        if self.outcomes == 0:
            self.idle += 1
            if self.idle >= self.probe_every:
                self.idle, self.outcomes = 0, 1
        return self.outcomes


class PreDraftService:
    def __init__(self, engine, on_record: Callable | None = None):
        self.engine = engine
        # a tensor-parallel leader (drafter.service.tp) has no predraft verb: the config refuses that pairing
        self.enabled = bool(getattr(getattr(engine, "config", None), "predraft_outcomes", 0)) and \
            hasattr(engine, "predraft")
        self.latest: dict[str, PreDrafts] = {}  # session id -> the last set pushed (the client's block ids)
        # session id -> {(first block, drafted-from position): the drafts the target verifies next are a pre-draft}
        self.sources: dict[str, dict[tuple[int, int], bool]] = {}
        # on_record(rows_by_a, hits_by_a, outcomes): metrics (ServiceCore sets it)
        self.on_record = on_record or (lambda rows, hits, outcomes: None)
        # on_acceptance(source, verified_by_position, accepted_by_position), source "predraft" | "exact"
        self.on_acceptance = lambda source, verified, accepted: None
        # busy(): whether a request waits for the engine (ServiceCore sets it); pre-drafting then
        # yields: it never delays exact drafting for a session.  on_skip(): metrics of a set not made
        self.busy: Callable[[], bool] = lambda: False
        self.on_skip = lambda: None
        self.budgets: dict[str, Budget] = {}  # session id -> its adaptive budget
        # session id -> {(first block, drafted-from position): the pre-draft this side counted the target as verifying}
        self.believed: dict[str, dict[tuple[int, int], tuple[int, ...]]] = {}
        # on_budget(outcomes, late): the budget of a set made (or 0 when none), and whether a late set was seen
        self.on_budget = lambda outcomes, late: None

    def after_batch(self, items, results) -> None:
        """Engine thread, once every reply of the batch is out."""
        if not self.enabled:
            return
        for it, result in zip(items, results):
            push = getattr(it, "push", None)
            if push is None or not it.call.want_predrafts or isinstance(result, BaseException) or result is None:
                continue
            if it.call.inputs.target_hidden_states is None:  # CUDA IPC: the states are not at hand here
                continue
            budget = self.budgets.setdefault(it.session.id, Budget(self.engine.config.predraft_outcomes))
            try:
                if self.busy():  # exact drafting waits for the engine: no pre-drafts this time
                    budget.late()
                    self.forget(it.session.id, keep_budget=True)  # the next call's drafts are exact ones
                    self.on_skip()
                    pre = None
                else:
                    pre = self._predraft(it, result, budget)
                # none made: say so, so that a target waiting for this call's set stops waiting
                push(pre if pre is not None else nothing(it.call.request_id, result.draft_token_ids.shape))
            except Exception:  # noqa: BLE001 - the call was answered; pre-drafts are an extra
                log.exception("pre-drafting failed; an empty set pushed")
                self.forget(it.session.id, keep_budget=True)
                try:
                    push(nothing(it.call.request_id, result.draft_token_ids.shape))
                except Exception:  # noqa: BLE001
                    log.exception("pushing the empty set failed")

    def _predraft(self, it, result, budget: Budget) -> PreDrafts | None:
        call, session = it.call, it.session
        outcomes = outcomes_of_call(call.inputs, call.accepted_counts)
        late = self._late_rows(session.id, outcomes)
        if late:
            budget.late()
        elif late is not None:
            budget.in_time()
        hits = [lookup(self.latest.get(session.id), o) for o in outcomes]
        self._acceptance(session.id, outcomes)
        n = budget.take()
        self.on_budget(n, bool(late))
        if n == 0:  # the target gets its sets too late: none (the next call's drafts are exact)
            self.forget(session.id, keep_budget=True)
            return None
        used, flags = merge(result.draft_token_ids, hits)
        pre = self.engine.predraft(offset_inputs(session, call.inputs), used, call.request_id,
                                   outcomes=n)
        pre = replace(pre, block_ids=pre.block_ids - session.bases[0], log_probs=None)
        self.latest[session.id] = pre
        keys = [(int(b), int(p)) for b, p in zip(pre.block_ids.tolist(), pre.positions.tolist())]
        self.sources[session.id] = dict(zip(keys, flags))
        self.believed[session.id] = {key: tuple(used[r].tolist()) for r, key in enumerate(keys) if flags[r]}
        rows, got = {}, {}
        for o, hit in zip(outcomes, flags):
            if o is not None:
                rows[o.accepted] = rows.get(o.accepted, 0) + 1
                got[o.accepted] = got.get(o.accepted, 0) + int(hit)
        self.on_record(rows, got, int((pre.accepted >= 0).sum()))
        return pre

    def _late_rows(self, session_id: str, outcomes) -> int | None:
        """Rows this side counted as verifying a pre-draft that the target verified other drafts
        for (it had not got the set in time); None when no row was counted a hit.  Those rows
        count as exact from now on."""
        believed = self.believed.get(session_id)
        if not believed:
            return None
        late = 0
        for o in outcomes:
            want = None if o is None else believed.get((o.block_id, o.position))
            if want is not None and tuple(want[:len(o.verified)]) != o.verified:
                late += 1
                self.sources.get(session_id, {})[(o.block_id, o.position)] = False
        return late

    def _acceptance(self, session_id: str, outcomes) -> None:
        """Per draft position, drafts verified and accepted in this call's outcomes, split by whether
        the verified drafts were a pre-draft or the exact drafts of the previous call."""
        sources = self.sources.get(session_id, {})
        counts = {"predraft": ({}, {}), "exact": ({}, {})}
        for o in outcomes:
            was_pre = None if o is None else sources.get((o.block_id, o.position))
            if was_pre is None:
                continue
            verified, accepted = counts["predraft" if was_pre else "exact"]
            for i in range(len(o.verified)):
                verified[i + 1] = verified.get(i + 1, 0) + 1
                accepted[i + 1] = accepted.get(i + 1, 0) + int(i < o.accepted)
        for source, (verified, accepted) in counts.items():
            if verified:
                self.on_acceptance(source, verified, accepted)

    def forget(self, session_id: str, keep_budget: bool = False) -> None:
        """Drop the session's pre-drafts (the next call's drafts are exact ones); keep_budget: a
        skip, not the session's end."""
        self.latest.pop(session_id, None)
        self.believed.pop(session_id, None)
        self.sources.pop(session_id, None)
        if not keep_budget:
            self.budgets.pop(session_id, None)
