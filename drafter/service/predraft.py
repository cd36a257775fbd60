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

Bound cuda_ipc sessions (BoundPreDrafts, one per binding) pre-draft for steps whose header asks
(StepHeader.want_predrafts) with the same bookkeeping (begin / keep) and push on the binding's
own channel after the StepDone (docs/predraft.md, "On bound sessions").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from drafter.service.sessions import offset_inputs
from drafter.wire.predraft import PreDrafts, lookup, merge, outcomes_of_call, verifies_predrafts
from drafter.wire.records import ProposeInputs

log = logging.getLogger("drafter.service.predraft")

# A bench's hook (drafter.tools.bench.predraft record_stages): called after each bound pre-draft's push
# with (session id, step, [(stage, perf_counter_ns)...], the pre-draft's GPU microseconds or None).
# None (the default): no marks are taken.
BOUND_MARKS: Callable[[str, int, list, float | None], None] | None = None
# How long an awaited bound step's pre-draft waits for the target's TAKEN (it normally comes as soon as
# the target holds the drafts, well under a millisecond after the StepDone): past it the binding's
# pre-drafts stop waiting until a TAKEN comes again.
TAKEN_WAIT_S = 0.05


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
        hits, n = self.begin(session.id, outcomes, budget)
        if n == 0:
            return None
        used, flags = merge(result.draft_token_ids, hits)
        pre = self.engine.predraft(offset_inputs(session, call.inputs), used, call.request_id,
                                   outcomes=n)
        pre = replace(pre, block_ids=pre.block_ids - session.bases[0], log_probs=None)
        self.keep(session.id, pre, used, flags, outcomes)
        return pre

    def begin(self, session_id: str, outcomes, budget: Budget) -> tuple[list, int]:
        """Before a call's pre-draft, from the call's outcomes (outcomes_of_call): late sets seen
        (the budget halves) or sets in time (it grows), which rows the target verified a pushed
        pre-draft for (hits, per row [k'] or None), the acceptance metrics, and this call's budget
        n; at 0 the session's pre-drafts are dropped (the next call's drafts are exact ones)."""
        late = self._late_rows(session_id, outcomes)
        if late:
            budget.late()
        elif late is not None:
            budget.in_time()
        hits = [lookup(self.latest.get(session_id), o) for o in outcomes]
        self._acceptance(session_id, outcomes)
        n = budget.take()
        self.on_budget(n, bool(late))
        if n == 0:  # the target gets its sets too late: none (the next call's drafts are exact)
            self.forget(session_id, keep_budget=True)
        return hits, n

    def keep(self, session_id: str, pre: PreDrafts, used: torch.Tensor,  # [batch, k] the drafts verified
             flags: list[bool], outcomes) -> None:
        """After a call's pre-draft (its block ids the client's): the set the next call is read
        against, which rows verify a pre-draft, and the hit metrics."""
        self.latest[session_id] = pre
        keys = [(int(b), int(p)) for b, p in zip(pre.block_ids.tolist(), pre.positions.tolist())]
        self.sources[session_id] = dict(zip(keys, flags))
        self.believed[session_id] = {key: tuple(used[r].tolist()) for r, key in enumerate(keys) if flags[r]}
        rows, got = {}, {}
        for o, hit in zip(outcomes, flags):
            if o is not None:
                rows[o.accepted] = rows.get(o.accepted, 0) + 1
                got[o.accepted] = got.get(o.accepted, 0) + int(hit)
        self.on_record(rows, got, int((pre.accepted >= 0).sum()))

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


class BoundPreDrafts:
    """Pre-drafts for one cuda_ipc binding's steps that ask (StepHeader.want_predrafts), pushed on
    the channel the step's StepDone took (drafter.wire.predraft.bound_push_frame).

    Under the engine's lock, queued before the step's "drafts ready" event (keep): the drafted-from
    rows' hidden states gathered from the target's slab into a buffer of this binding on the
    engine's device (a device copy: once the event fires the slab is the target's to overwrite).
    After the StepDone has gone (after_reply, on the thread that sent it): the call's small fields
    and exact drafts copied to the host (queued under the lock, waited for outside it), its outcomes
    read and looked up against the last set pushed (PreDraftService.begin: the same late detection,
    budget and metrics as unbound pushes; none while a request, job or another binding's step waits
    for the engine), the pre-draft queued under the lock
    (drafter.engine.predraft.predraft_queued) over the kept rows and the guard's outputs (the
    binding's own buffers: the next step rewrites them only after this), its outcomes read outside
    it, and the set pushed.  A skipped or failed pre-draft pushes an empty set (`nothing`)."""

    def __init__(self, service: PreDraftService, engine, session, views: dict, guard_out: dict,
                 drafts: torch.Tensor,  # [max_batch, width] int64: the binding's drafts output
                 device: torch.device, epoch: int, waiting: Callable[[], int] = lambda: 0):
        """waiting(): how many bound steps wait for the engine's lock now (a pre-draft yields to them)."""
        from drafter.wire.bound import HIDDEN

        self.service, self.engine, self.session, self.epoch, self.waiting = service, engine, session, epoch, waiting
        self.hidden = views[HIDDEN]  # [max_tokens, W]: the target's slab
        self.out, self.drafts, self.device = guard_out, drafts, device
        self.groups = len(session.num_blocks)
        self.k = engine.config.num_speculative_tokens
        max_batch = drafts.shape[0]
        self.kept = torch.zeros(max_batch, self.hidden.shape[1], dtype=self.hidden.dtype, device=device)  # [B, W]
        self.sample = torch.zeros(max_batch, dtype=torch.long, device=device)  # [B] the drafted-from rows
        self.iota = torch.arange(max_batch + 1, dtype=torch.long, device=device)  # [B + 1]
        self.pending = None  # the StepHeader of a step whose rows were kept, until after its reply
        # the target's TAKEN words (drafter.wire.predraft.TAKEN): once one came on this binding, the target
        # sends one for each awaited step, and that step's pre-draft waits for it (at most TAKEN_WAIT_S)
        self.taken_seen = False
        self.taken_step = 0  # the latest step a TAKEN named
        self._caught = None  # a frame read while waiting for a TAKEN that was not one: the loop's next
        self._marks: list | None = None  # this pre-draft's stage marks, while BOUND_MARKS is set
        self._gpu = None  # (start, end) timing events around its GPU work, while BOUND_MARKS is set
        service.forget(session.id)  # a new binding: its steps are counted from 1 again

    def keep(self, head) -> None:
        """Engine lock held, queued after the step's replay and before its done event: the
        drafted-from rows' hidden states (as the engine chooses the rows) into `kept`."""
        b, o = head.batch, self.out
        sample = o.get("token_indices_to_sample")
        if sample is not None:
            self.sample[:b].copy_(sample[:b])
        else:
            torch.sub(o["query_start_loc"][1:b + 1], 1, out=self.sample[:b])
            if "num_rejected_tokens" in o:
                self.sample[:b].sub_(o["num_rejected_tokens"][:b])
        torch.index_select(self.hidden, 0, self.sample[:b], out=self.kept[:b])
        self.pending = head

    def note_taken(self, frame) -> bool:
        """Whether `frame` is the target's TAKEN (then noted: from now on awaited steps' pre-drafts
        wait for theirs); the channel's loop drops one that no pre-draft waited for."""
        from drafter.wire.predraft import taken_step

        step = taken_step(frame)
        if step is None:
            return False
        self.taken_seen, self.taken_step = True, max(self.taken_step, step)
        return True

    def after_reply(self, send: Callable[[bytes], None], on_engine: Callable, limit: int = 0,
                    receive: Callable[[float], bytes | None] | None = None) -> bytes | None:
        """After the StepDone went out: pre-draft (on_engine(fn, *args) runs fn under the engine's
        lock) and push the set with send(frame); an empty set when none was made, or when the
        set's frame is longer than `limit` bytes (0: no limit).  receive(seconds) -> the channel's
        next frame or None (the doorbell's): where the target sends TAKEN words, an awaited step's
        pre-draft queues its GPU work only after the target's TAKEN for it, so it never runs while
        the target still reads the step's drafts.  Returns a frame read meanwhile that was not a
        TAKEN (the target's next header or WAKE: the loop's to handle), else None."""
        head, self.pending = self.pending, None
        self._caught = None
        if head is None:
            return None
        hook = BOUND_MARKS
        self._marks = marks = None if hook is None else [("after_reply", time.perf_counter_ns())]
        self._gpu = None
        try:
            pre = self._predraft(head, on_engine, receive)
        except Exception:  # noqa: BLE001 - the step was answered; pre-drafts are an extra
            log.exception("bound pre-drafting failed; an empty set pushed")
            self.service.forget(self.session.id, keep_budget=True)
            pre = None
        if pre is None:
            pre = nothing(head.step, (head.batch, self.k))
        from drafter.wire.predraft import bound_push_frame

        frame = bound_push_frame(pre, self.session.id, self.epoch)
        if limit and len(frame) > limit:
            self.service.forget(self.session.id, keep_budget=True)  # the next step's drafts are exact ones
            frame = bound_push_frame(nothing(head.step, (head.batch, self.k)), self.session.id, self.epoch)
        try:
            send(frame)
        except Exception:  # noqa: BLE001 - the target went away: its next step says so
            log.debug("pushing a bound pre-draft set failed", exc_info=True)
        if marks is not None:
            marks.append(("pushed", time.perf_counter_ns()))
            self._call_hook(hook, head.step, marks)
        return self._caught

    def _await_taken(self, step: int, receive: Callable[[float], bytes | None]) -> None:
        """Until the target's TAKEN for `step` (or a later one) came: at most TAKEN_WAIT_S, after
        which this binding's pre-drafts stop waiting until a TAKEN comes again.  A frame that is
        not a TAKEN (the target went on without sending one) ends the wait and is kept for the loop."""
        deadline = time.monotonic() + TAKEN_WAIT_S
        while self.taken_step < step:
            left = deadline - time.monotonic()
            frame = receive(left) if left > 0 else None
            if frame is None:  # none in time: the target stopped sending them
                self.taken_seen = False
                return
            if not self.note_taken(frame):
                self._caught = frame
                return

    def _mark(self, stage: str) -> None:
        if self._marks is not None:
            self._marks.append((stage, time.perf_counter_ns()))

    def _call_hook(self, hook, step: int, marks: list) -> None:
        """The bench's hook with this pre-draft's marks and its GPU time (timing events, read now)."""
        gpu = None
        if self._gpu is not None:
            try:
                self._gpu[1].synchronize()  # recorded just after the outputs' copies the pre-draft waited for
                gpu = self._gpu[0].elapsed_time(self._gpu[1]) * 1e3
            except Exception:  # noqa: BLE001 - a measurement only
                gpu = None
        try:
            hook(self.session.id, step, marks, gpu)
        except Exception:  # noqa: BLE001 - a measurement only
            log.debug("the bound pre-draft marks hook failed", exc_info=True)

    def _predraft(self, head, on_engine, receive=None) -> PreDrafts | None:
        svc, sid = self.service, self.session.id
        budget = svc.budgets.setdefault(sid, Budget(self.engine.config.predraft_outcomes))
        if svc.busy() or self.waiting():  # work waits for the engine (a request, a job, a bound step): none
            budget.late()
            svc.forget(sid, keep_budget=True)
            svc.on_skip()
            return None
        host, done = on_engine(self._fields_to_host, head)
        if done is not None:
            done.synchronize()
        self._mark("fields")
        inp, exact = self._host_inputs(head, host)
        counts = torch.tensor(head.accepted_counts, dtype=torch.long) if head.accepted_counts else None
        outcomes = outcomes_of_call(inp, counts)
        hits, n = svc.begin(sid, outcomes, budget)
        if n == 0:
            return None
        awaited = not verifies_predrafts(hits, head.predraft_min_hits)
        if awaited:  # the target waited: exact drafts everywhere
            hits = [None] * len(hits)
        used, flags = merge(exact, hits)
        self._mark("decided")
        if awaited and receive is not None and self.taken_seen:  # not while the target reads the drafts
            self._await_taken(head.step, receive)
            self._mark("taken")
        finish = on_engine(self._queue, head, used, n)
        self._mark("queued")
        pre = finish()
        self._mark("finished")
        pre = replace(pre, block_ids=pre.block_ids - self.session.bases[0], log_probs=None)
        svc.keep(sid, pre, used, flags, outcomes)
        return pre

    def _fields_to_host(self, head):
        """Engine lock held: the step's fields that outcomes_of_call reads, and its exact drafts,
        copied to the host (queued; the event to wait on, None on a CPU engine)."""
        from drafter.engine.predraft import to_host

        n, b, o = head.num_tokens, head.batch, self.out
        rejected = o["num_rejected_tokens"][:b] if "num_rejected_tokens" in o else self.iota[:b] * 0
        return to_host([o["target_token_ids"][:n], o["target_positions"][:n], o["query_start_loc"][:b + 1],
                        rejected, o["next_token_ids"][:b], o["block_tables[0]"][:b, :1], self.drafts[:b, :self.k]])

    def _host_inputs(self, head, host) -> tuple[ProposeInputs, torch.Tensor]:
        """The call as outcomes_of_call reads it (block ids the client's) and its exact drafts [b, k]."""
        ids, positions, qsl, rejected, nxt, first_block, exact = host
        b = head.batch
        empty = torch.zeros(0, dtype=torch.long)
        inp = ProposeInputs(ids, positions, None, nxt, qsl, empty, [first_block.long() - self.session.bases[0]],
                            [empty], None, rejected)
        return inp, exact.long().view(b, self.k)

    def _queue(self, head, used: torch.Tensor, outcomes: int):  # used: [b, k] int64 on the host
        """Engine lock held: the pre-draft over the kept rows and the guard's outputs, queued."""
        from drafter.engine.predraft import predraft_queued

        b, o = head.batch, self.out
        positions = o["target_positions"].index_select(0, self.sample[:b])
        rows = self.iota[:b]
        inp = ProposeInputs(positions, positions, self.kept[:b], o["next_token_ids"][:b], self.iota[:b + 1],
                            o["seq_lens"][:b], [o[f"block_tables[{g}]"][:b] for g in range(self.groups)],
                            [positions], token_indices_to_sample=rows)
        if self.device.type == "cuda":  # a pageable copy would wait for the stream (the step's replay)
            used = used.pin_memory().to(self.device, non_blocking=True)
        timed = self._marks is not None and self.device.type == "cuda"
        if timed:  # the bench's GPU time of the pre-draft (timing events around its queued work)
            stream = torch.cuda.current_stream(self.device)
            self._gpu = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._gpu[0].record(stream)
        finish = predraft_queued(self.engine, inp, used.to(self.device), head.step, outcomes)
        if timed:
            self._gpu[1].record(stream)
        return finish
