"""Bound steps of several bindings that wait for the engine at the same moment, served as ONE engine call.

    the session's thread, its step received (bound_sessions.BoundSession.run_step, bound_ipc.IpcBoundSession._run):
        ticket = steps.enter(session, head, nbytes)      # pending from now on
        take the engine (the engine thread's job, or the engine's lock on the data thread)
        steps.serve(ticket)                              # under the engine's lock
    serve:
        the ticket already served by another binding's serve (it took it, under the same lock): its answer
        else every ticket pending now is taken; one alone runs session.serve_alone (its step, as
        without fusion);
        several are planned into groups whose summed sizes fit the engine's largest captured sizes
        (and its limits), each group one engine call:
            session.fuse_part(head, nbytes) each: the step's own checks, refusals and guard, as its
                step() makes them; the rows of its binding's buffers (a refused one leaves the group)
            the rows concatenated (batching.fuse: one device copy per tensor per session), the
                engine's normal call at the smallest captured sizes covering the sums
            session.fused_drafts(head, rows) each: its drafts into its own output (cuda_ipc: its
                "drafts ready" event recorded); one host sync where the engine is on a GPU and a step
                answers with its drafts (host_reply: the host ring); session.fused_reply(head) each:
                its answer (a host-ring guarded step whose error word is set: INVALID_ARGUMENT naming
                the field, as alone; cuda_ipc: the target reads the error word, as alone)

No waiting for company: a step fuses only with steps whose tickets are pending when the engine's
lock is taken; alone, a step costs a ticket, a list append and a swap more than before.  Which
bindings take part: the host ring (host checks or the GPU guard; data socket or ring stream), the
gloo channel, and unarmed cuda_ipc bindings; an armed cuda_ipc binding (its steps queued ahead on
the GPU) and nccl_channel steps keep their own path.  Tickets fuse only with tickets whose binding
reads buffers on the same device with the same hidden-state dtype.

Each request's drafts depend only on its own rows and KV, not on the other requests of a call nor on
the padding (tests/unit/test_padding_invariance.py on CPU; the batcher fuses unbound calls on the
same ground); on a GPU the fused call may run a GEMM at other sizes than a step alone (a larger
padded token count), which tests/gpu/test_bound_fused.py avoids by fusing at the solo steps' padded
sizes.  Each header's agreed padded sizes are checked as its own call would check them (the fused
call runs at its own), and each session's block ids and slots were moved into its own pool range
(host checks) or masked there (the guard) before the rows are gathered, so no step's KV writes leave
its session's blocks.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from drafter.service.batching.fuse import fuse

log = logging.getLogger("drafter.service.bound")


class BoundStep:
    """One bound step waiting for the engine: its session, header and ring bytes; its answer once served."""

    __slots__ = ("session", "head", "nbytes", "taken", "result", "error")

    def __init__(self, session, head, nbytes: int):
        self.session = session  # a drafter.service.bound_sessions.BoundSession (step, fuse_part, fused_*)
        self.head = head  # drafter.wire.bound.StepHeader
        self.nbytes = nbytes
        self.taken = False  # a serve took it (answered within that serve's hold of the engine's lock)
        self.result: object = b""  # the session's answer (serve_alone's or fused_reply's)
        self.error: BaseException | None = None


class BoundSteps:
    """The bound steps pending for one engine (one per drafter.service.bound_sessions.BoundPlane)."""

    def __init__(self, core):
        self.core = core
        self._lock = threading.Lock()  # the pending list's (a plain lock: ~0.1 us a step alone)
        self._cond = threading.Condition(self._lock)  # notified only while someone waits (wait_pending)
        self._watchers = 0
        self._pending: list[BoundStep] = []
        self.fused_calls = 0  # engine calls that served several bindings' steps
        self.fused_steps = 0  # steps served by them

    # ------------------------------------------------------------------ the session's thread
    def run(self, session, head, nbytes: int, take):
        """The step's answer (the session's: the host ring's drafts' bytes, cuda_ipc's stamps; raises
        its refusal): pending from now, then take(serve, ticket) runs serve under the engine's lock."""
        ticket = self.enter(session, head, nbytes)
        try:
            return take(self.serve, ticket)
        finally:
            if not ticket.taken:  # take failed before serve (the engine shut down): not pending any more
                self.leave(ticket)

    def enter(self, session, head, nbytes: int) -> BoundStep:
        ticket = BoundStep(session, head, nbytes)
        with self._lock:
            self._pending.append(ticket)
            if self._watchers:
                self._cond.notify_all()
        return ticket

    def leave(self, ticket: BoundStep) -> None:
        with self._lock:
            if ticket in self._pending:
                self._pending.remove(ticket)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def wait_pending(self, count: int, timeout_s: float) -> bool:
        """Whether `count` steps are pending within timeout_s (tests: the overlap made deterministic)."""
        with self._cond:
            self._watchers += 1
            try:
                return self._cond.wait_for(lambda: len(self._pending) >= count, timeout_s)
            finally:
                self._watchers -= 1

    # ------------------------------------------------------------------ under the engine's lock
    def serve(self, ticket: BoundStep):
        """Engine lock held: the ticket's answer, with every step pending now served first."""
        if not ticket.taken:
            with self._lock:
                batch, self._pending = self._pending, []
            if len(batch) == 1 and batch[0] is ticket:  # alone: its own step, no more frames than that
                ticket.taken = True
                return ticket.session.serve_alone(ticket.head, ticket.nbytes)
            for t in batch:  # the batch is this thread's alone now: the owners look only at their own
                t.taken = True
            if not ticket.taken:  # (cannot happen: a ticket is pending until taken) served all the same
                ticket.taken = True
                batch.append(ticket)
            self._serve(batch)
        if ticket.error is not None:
            raise ticket.error
        return ticket.result

    def _serve(self, batch: list[BoundStep]) -> None:
        if len(batch) == 1:
            self._alone(batch[0])
            return
        # other bindings' steps on this thread: the engine's GPU current (Triton launches follow it),
        # whichever thread took the lock (the engine thread for a host-checked step, a data thread else)
        with self.core.engine.on_device():
            for group in self._plan(batch):
                if len(group) == 1:
                    self._alone(group[0])
                else:
                    self._fused(group)

    @staticmethod
    def _alone(t: BoundStep) -> None:
        """The step as its session serves it without fusion (its step, timed where the plane stamps it)."""
        try:
            t.result = t.session.serve_alone(t.head, t.nbytes)
        except BaseException as exc:  # noqa: BLE001 - the owner's thread raises it
            t.error = exc

    def _limits(self) -> tuple[int, int]:
        """(batch, tokens) one fused call may hold: the largest captured sizes within the engine's limits."""
        engine = self.core.engine
        runner, limits = engine.graphs, engine.limits
        if runner is None or not runner.batch_sizes or not runner.token_sizes:
            return 0, 0
        return min(max(runner.batch_sizes), limits.max_num_seqs), \
            min(max(runner.token_sizes), limits.max_num_batched_tokens)

    def _plan(self, batch: list[BoundStep]) -> list[list[BoundStep]]:
        """Groups in arrival order: a step joins the open group of its kind (device, hidden dtype)
        while the summed sizes fit; a step whose own sizes do not fit runs alone (its step refuses it)."""
        max_b, max_t = self._limits()
        groups: list[list[BoundStep]] = []
        open_: dict[tuple, tuple[list[BoundStep], int, int]] = {}
        for t in batch:
            b, n = t.head.batch, t.head.num_tokens
            if not (0 < b <= n and b <= max_b and n <= max_t):
                groups.append([t])
                continue
            inputs = t.session.bound.inputs
            kind = (inputs.target_token_ids.device, inputs.target_hidden_states.dtype)
            group, gb, gn = open_.get(kind, (None, 0, 0))
            if group is None or gb + b > max_b or gn + n > max_t:
                group, gb, gn = [], 0, 0
                groups.append(group)
            group.append(t)
            open_[kind] = (group, gb + b, gn + n)
        return groups

    def _fused(self, group: list[BoundStep]) -> None:
        """One engine call for the group's steps; each step refused on its own keeps its refusal."""
        started = time.perf_counter_ns()
        live, parts = [], []
        for t in group:
            try:
                parts.append(t.session.fuse_part(t.head, t.nbytes))
                live.append(t)
            except BaseException as exc:  # noqa: BLE001 - this step's answer; the others go on
                t.error = exc
        if not live:
            return
        try:
            drafts, rows = self._draft(live, parts)
            queued = time.perf_counter_ns()
            for t, (r0, r1) in zip(live, rows):
                t.session.fused_drafts(t.head, drafts[r0:r1])
            device = drafts.device
            if device.type == "cuda" and any(t.session.host_reply for t in live):
                torch.cuda.current_stream(device).synchronize()  # the drafts and error words on the host: one wait
        except BaseException as exc:  # noqa: BLE001 - a bug of ours: every step of the call gets it
            log.exception("fused bound steps failed")
            for t in live:
                t.error = exc
            return
        for t in live:
            t.session.fused_stamps(started, queued)
            try:
                t.result = t.session.fused_reply(t.head)
            except BaseException as exc:  # noqa: BLE001
                t.error = exc
        if len(live) > 1:  # (the others refused: one step alone in the call is not a fused one)
            self.fused_calls += 1
            self.fused_steps += len(live)
            metrics = self.core.metrics
            metrics.bound_fused_calls.inc()
            metrics.bound_fused_steps.inc(len(live))

    def _draft(self, live: list[BoundStep], parts: list) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The group's rows gathered, the engine's call at the smallest captured sizes covering them;
        its drafts ([sum of batches, width] int64, on the engine's device) and each step's rows."""
        engine = self.core.engine
        dtype = parts[0].target_hidden_states.dtype  # one dtype a group (_plan): read as each step's own call reads it
        inp, rows = fuse(parts, [t.session.session.bases for t in live], dtype)
        b, n = rows[-1][1], int(inp.target_token_ids.shape[0])
        runner = engine.graphs
        b_pad = min(s for s in runner.batch_sizes if s >= b)
        t_pad = min(s for s in runner.token_sizes if s >= n)
        out = engine.draft(inp, batch_padded=b_pad, tokens_padded=t_pad, validate=False)
        return out.draft_token_ids, rows
