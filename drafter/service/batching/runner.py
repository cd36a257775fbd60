"""The engine-thread side of a batch: check each request, plan what fits, fuse, run, split.

Each step of a request's way to the engine is a method marked with @probes.staged: the stage
timings of drafter.wire.probes cost nothing while probes are off, and the steps read without them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from drafter.service.batching.checks import check_finite, engine_validate
from drafter.service.batching.fuse import fuse
from drafter.service.batching.stage import HostStager
from drafter.service.predraft import PreDraftService
from drafter.service.sessions import offset_inputs
from drafter.wire import probes
from drafter.wire.cuda_ref import FIELD as IPC_FIELD
from drafter.wire.errors import Code, DrafterError, from_exception, invalid
from drafter.wire.records import DraftOutput, ProposeInputs, ProposeResult

if TYPE_CHECKING:
    from drafter.service.batching.queue import Pending

log = logging.getLogger("drafter.service.batching")


def _its_call(self, it, *rest):
    return (it.call,)


def _group_calls(self, items, group, *rest):
    return [items[i].call for i, _ in group]


@dataclass
class EngineCall:
    """What one fused engine call did (for metrics)."""

    requests: int
    sessions: int
    batch: int
    batch_padded: int
    tokens: int
    tokens_padded: int
    seconds: float


class EngineRunner:
    """The worker-thread side: validate each request, fuse what fits, run, split."""

    def __init__(self, engine, on_engine_call=None, cuda_ipc=None):
        """cuda_ipc: a drafter.service.cuda_ipc.CudaIpcOpener where references are accepted, else None."""
        self.engine = engine
        self.cuda_ipc = cuda_ipc
        cfg = engine.config
        self.max_batch = cfg.max_num_seqs
        self.max_tokens = cfg.max_num_batched_tokens
        self.hidden_dtype = cfg.torch_dtype
        self.on_engine_call = on_engine_call or (lambda ec: None)
        self.busy_since: float | None = None  # for the liveness check
        self.predrafts = PreDraftService(engine)  # --predraft-outcomes: pushed after the replies
        # True (the Batcher sets it): engine-call records wait in `deferred` until the replies are out
        self.defer_records = False
        self.deferred: list[EngineCall] = []
        device = getattr(engine, "device", None)
        limits = getattr(engine, "limits", None)
        self.stager = None
        if device is not None and torch.device(device).type == "cuda" and limits is not None:
            # sized for the largest call the engine accepts: hidden states in the widest dtype a session
            # may send, and its int64 metadata (ids, positions, slots; per request rows and block tables)
            tokens, reqs, groups = cfg.max_num_batched_tokens, cfg.max_num_seqs, len(cfg.kv_groups)
            ints = 8 * (tokens * (2 + groups) + reqs * 6 + reqs * sum(cfg.max_blocks_per_req)) + 64 * (8 + 2 * groups)
            self.stager = HostStager(tokens * limits.hidden_width * 4 + ints)

    def flush_records(self) -> None:
        records, self.deferred = self.deferred, []
        for record in records:
            try:
                self.on_engine_call(record)
            except Exception:  # noqa: BLE001 - metrics only
                log.exception("engine-call metrics failed")

    def run_batch(self, items: list[Pending]) -> list:
        """Each request's ProposeResult or DrafterError, in order."""
        self.busy_since = time.monotonic()
        try:
            return self._run(items)
        finally:
            self.busy_since = None

    @probes.staged("handoff_in", lambda self, items: [it.call for it in items], before=True)
    def _run(self, items: list[Pending]) -> list:
        results: list = [None] * len(items)
        ready: list[tuple[int, ProposeInputs]] = []
        now = time.monotonic()
        # Alone in its engine call, a request needs no check of its own: engine.propose validates
        # everything before it writes anything, and its error can only be this request's.
        alone = len(items) == 1 and not (items[0].call.batch_padded or items[0].call.tokens_padded)
        for i, it in enumerate(items):
            if it.future is not None and it.future.cancelled():
                results[i] = DrafterError(Code.DEADLINE_EXCEEDED, "", "cancelled by the client")
            elif not it.session.alive:
                results[i] = DrafterError(Code.NOT_FOUND, "session_id", "the session was detached")
            elif it.call.deadline is not None and now > it.call.deadline:
                results[i] = DrafterError(Code.DEADLINE_EXCEEDED, "", "deadline passed before the engine was free")
            else:
                try:
                    ready.append((i, self._prepare(it, alone)))
                except Exception as exc:  # noqa: BLE001 - every failure becomes that request's answer
                    # without its traceback: its frames hold the request's tensors (a CUDA IPC view must be
                    # released in this thread, not wherever the error ends up)
                    results[i] = from_exception(exc).with_traceback(None)
        for group in self._plan(items, ready):
            self._run_group(items, group, results)
        return results

    def _prepare(self, it: Pending, alone: bool) -> ProposeInputs:
        """The request's engine inputs, its shared hidden states opened, checked before any KV write."""
        inp = self._offsets(it)
        if it.call.hidden_ipc is not None:
            inp = self._open_shared(it, inp)
        if alone and self.stager is not None:
            # staged here rather than in _run_group (which passes the staged inputs on): the finite check
            # below then reads the staged copy while it is still in cache, not the message again
            inp = self.stager.stage(inp)
        # first in both paths (alone or fused), so a request's error never depends on its batch
        self._check_finite(it, inp)
        if not alone:
            engine_validate(self.engine, inp)
        return inp

    @probes.staged("session_offsets", _its_call)
    def _offsets(self, it: Pending) -> ProposeInputs:
        return offset_inputs(it.session, it.call.inputs)

    @probes.staged("ipc_open", _its_call)
    def _open_shared(self, it: Pending, inp: ProposeInputs) -> ProposeInputs:
        return replace(inp, target_hidden_states=self._shared_hidden(it))

    @probes.staged("finite_check", _its_call)
    def _check_finite(self, it: Pending, inp: ProposeInputs) -> None:
        check_finite(inp, IPC_FIELD if it.call.hidden_ipc is not None else "target_hidden_states")

    def _shared_hidden(self, it: Pending) -> torch.Tensor:  # [num_tokens, hidden_width] on the GPU
        if self.cuda_ipc is None:  # ServiceCore.check refuses these first; kept for direct callers
            raise invalid(IPC_FIELD, "this drafter does not open CUDA IPC references")
        return self.cuda_ipc.tensor(it.session.id, it.call.hidden_ipc)

    def forget_session(self, session_id: str) -> None:
        """Engine thread: release what the session opened (CUDA IPC storages and events)."""
        if self.cuda_ipc is not None:
            self.cuda_ipc.forget(session_id)
        self.predrafts.forget(session_id)

    def _plan(self, items, ready) -> list[list[tuple[int, ProposeInputs]]]:
        """Greedy packing up to the engine's limits; agreed padded sizes (DP) run alone."""
        groups, current, b, n = [], [], 0, 0
        for i, inp in ready:
            call = items[i].call
            if call.batch_padded or call.tokens_padded:
                groups.append([(i, inp)])
                continue
            cb, cn = call.batch_size, call.num_tokens
            if current and (b + cb > self.max_batch or n + cn > self.max_tokens):
                groups.append(current)
                current, b, n = [], 0, 0
            current.append((i, inp))
            b, n = b + cb, n + cn
        if current:
            groups.append(current)
        return groups

    @probes.staged("prepare", _group_calls)
    def _assemble(self, items, group) -> tuple[ProposeInputs, list[tuple[int, int]]]:
        """The group's one engine call (fused when it has several requests, staged) and each
        request's rows of the drafts."""
        if len(group) == 1:
            inp, rows = group[0][1], [(0, items[group[0][0]].call.batch_size)]
        else:
            inp, rows = fuse([part for _, part in group], [items[i].session.bases for i, _ in group],
                             self.hidden_dtype)
        return (self.stager.stage(inp) if self.stager is not None else inp), rows

    @probes.staged("engine", _group_calls)
    def _draft(self, items, group, inp: ProposeInputs) -> tuple[DraftOutput, float]:
        """The engine call, its drafts (and probabilities) on the host, and the seconds it took."""
        calls = [items[i].call for i, _ in group]
        t0 = time.perf_counter()
        out = self.engine.draft(
            inp, return_probs=any(c.return_probs for c in calls),
            batch_padded=calls[0].batch_padded or None, tokens_padded=calls[0].tokens_padded or None)
        # the drafts on the host here, in the engine thread: the event loop never waits on the GPU,
        # and the staged inputs have been read before the next call overwrites them
        out = replace(out, draft_token_ids=out.draft_token_ids.cpu(),
                      draft_probs=out.draft_probs.cpu() if out.draft_probs is not None else None)
        return out, time.perf_counter() - t0

    def _run_group(self, items, group, results) -> None:
        calls = [items[i].call for i, _ in group]
        try:
            inp, rows = self._assemble(items, group)
            out, seconds = self._draft(items, group, inp)
        except Exception as exc:  # noqa: BLE001
            if len(group) > 1:  # should not happen after per-request validation; keep the others safe
                log.error("fused engine call failed (%s); running its %d requests one by one", exc, len(group))
                for member in group:
                    self._run_group(items, [member], results)
                return
            results[group[0][0]] = from_exception(exc)
            return
        record = EngineCall(
            requests=len(group), sessions=len({items[i].session.id for i, _ in group}),
            batch=sum(c.batch_size for c in calls), batch_padded=out.batch_padded,
            tokens=sum(c.num_tokens for c in calls), tokens_padded=out.tokens_padded, seconds=seconds)
        if self.defer_records:
            self.deferred.append(record)
        else:
            self.on_engine_call(record)
        drafts, probs = out.draft_token_ids, out.draft_probs
        for (i, _), call, (r0, r1) in zip(group, calls, rows):
            p = probs[r0:r1] if call.return_probs and probs is not None else None
            results[i] = ProposeResult(call.request_id, drafts[r0:r1], p, out.batch_padded, out.tokens_padded,
                                       {"engine_s": seconds})
