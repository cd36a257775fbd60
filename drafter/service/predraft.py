"""Pre-drafting in the service: after a batch's replies have left, the engine thread pre-drafts
for each call that asked (ProposeRequest.want_predrafts, `--predraft-outcomes` > 0) and pushes the
result on the call's connection (drafter.wire.predraft, docs/predraft.md).

The pre-drafts are conditioned on the drafts the target will verify: on a hit, the target verifies
the previous pre-draft instead of this call's exact drafts, and this side finds the same hit from
the same pushed set (outcomes_of_call + lookup), so both ends agree without another message.
Pre-drafting never fails a call: its errors are logged and nothing is pushed.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

from drafter.service.sessions import offset_inputs
from drafter.wire.predraft import PreDrafts, lookup, merge, outcomes_of_call

log = logging.getLogger("drafter.service.predraft")


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
            if self.busy():  # exact drafting waits for the engine: no pre-drafts this time
                self.forget(it.session.id)  # the next call's drafts are exact ones
                self.on_skip()
                continue
            try:
                push(self._predraft(it, result))
            except Exception:  # noqa: BLE001 - the call was answered; pre-drafts are an extra
                log.exception("pre-drafting failed; nothing pushed")

    def _predraft(self, it, result) -> PreDrafts:
        call, session = it.call, it.session
        outcomes = outcomes_of_call(call.inputs, call.accepted_counts)
        hits = [lookup(self.latest.get(session.id), o) for o in outcomes]
        used, flags = merge(result.draft_token_ids, hits)
        self._acceptance(session.id, outcomes)
        pre = self.engine.predraft(offset_inputs(session, call.inputs), used, call.request_id)
        pre = replace(pre, block_ids=pre.block_ids - session.bases[0], log_probs=None)
        self.latest[session.id] = pre
        self.sources[session.id] = {(int(b), int(p)): hit for b, p, hit in
                                    zip(pre.block_ids.tolist(), pre.positions.tolist(), flags)}
        rows, got = {}, {}
        for o, hit in zip(outcomes, flags):
            if o is not None:
                rows[o.accepted] = rows.get(o.accepted, 0) + 1
                got[o.accepted] = got.get(o.accepted, 0) + int(hit)
        self.on_record(rows, got, int((pre.accepted >= 0).sum()))
        return pre

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

    def forget(self, session_id: str) -> None:
        self.latest.pop(session_id, None)
        self.sources.pop(session_id, None)
