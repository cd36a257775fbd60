"""Fused batching: requests of several sessions, collected within a window, run as ONE engine call.

The asyncio side (Batcher) only queues and waits; everything that touches the engine runs in one
dedicated worker thread (the engine is not thread-safe, and the event loop must stay free for
the transports).  In the worker each request is checked on its own first (session still alive,
deadline, the engine's full validation of its shifted block ids), so a bad one is refused alone
and never reaches the fused call; the good ones are concatenated, padded to common block-table
widths, run, and their drafts split back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

import torch

from drafter.inputs import ProposeInputs, as_group_list, validate
from drafter.service.errors import Code, DrafterError, from_exception, invalid
from drafter.service.sessions import Session, offset_kwargs
from drafter.service.wire import ProposeCall, ProposeResult

log = logging.getLogger("drafter.service.batcher")


@dataclass
class Pending:
    session: Session
    call: ProposeCall
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)


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


def _engine_validate(engine, kwargs: dict) -> None:
    groups = len(engine.config.kv_groups)
    inp = ProposeInputs(
        kwargs["target_token_ids"], kwargs["target_positions"], kwargs["target_hidden_states"],
        kwargs["next_token_ids"], kwargs["query_start_loc"], kwargs["seq_lens"],
        as_group_list("block_tables", kwargs["block_tables"], groups),
        as_group_list("slot_mappings", kwargs["slot_mappings"], groups),
        kwargs.get("token_indices_to_sample"), kwargs.get("num_rejected_tokens"), kwargs.get("temperatures"))
    validate(inp, engine.limits)


def _check_finite(kwargs: dict) -> None:
    # NaN/inf would only poison the sender's own KV, but a drafter should say so rather than draft garbage.
    hidden = kwargs["target_hidden_states"]
    if hidden.is_floating_point() and not bool(torch.isfinite(hidden).all()):
        raise invalid("target_hidden_states", "must be finite")


def _default_sample_indices(kw: dict) -> torch.Tensor:  # [batch] int64, the engine's own default
    idx = kw["query_start_loc"][1:].long() - 1
    if kw.get("num_rejected_tokens") is not None:
        idx = idx - kw["num_rejected_tokens"].long()
    return idx


def fuse(kws: list[dict], pads: list[tuple[int, ...]], hidden_dtype: torch.dtype) -> tuple[dict, list[tuple[int, int]]]:
    """Concatenate validated, already shifted requests into one engine call.

    pads[i][g]: a block id inside request i's own range, used to widen its block tables (the
    extra columns lie past every position it can reach, so they are never read or written).
    Returns the fused kwargs and each request's rows [start, end) of the drafts.
    """
    token_offsets, rows, t, b = [], [], 0, 0
    for kw in kws:
        token_offsets.append(t)
        n, nb = kw["target_token_ids"].shape[0], kw["next_token_ids"].shape[0]
        rows.append((b, b + nb))
        t, b = t + n, b + nb
    cat = lambda name: torch.cat([kw[name].to(torch.int64) for kw in kws])  # noqa: E731
    qsl = [torch.zeros(1, dtype=torch.int64)] + [kw["query_start_loc"][1:].to(torch.int64) + off
                                                 for kw, off in zip(kws, token_offsets)]
    fused = {
        "target_token_ids": cat("target_token_ids"),
        "target_positions": cat("target_positions"),
        "target_hidden_states": torch.cat([kw["target_hidden_states"].to(hidden_dtype) for kw in kws]),
        "next_token_ids": cat("next_token_ids"),
        "query_start_loc": torch.cat(qsl),
        "seq_lens": cat("seq_lens"),
        "slot_mappings": [torch.cat([kw["slot_mappings"][g] for kw in kws]) for g in range(len(pads[0]))],
    }
    tables = []
    for g in range(len(pads[0])):
        width = max(kw["block_tables"][g].shape[1] for kw in kws)
        parts = []
        for kw, pad in zip(kws, pads):
            tb = kw["block_tables"][g]
            if tb.shape[1] < width:
                tb = torch.cat([tb, torch.full((tb.shape[0], width - tb.shape[1]), pad[g], dtype=tb.dtype)], 1)
            parts.append(tb)
        tables.append(torch.cat(parts))
    fused["block_tables"] = tables
    if any(kw.get("num_rejected_tokens") is not None for kw in kws):
        fused["num_rejected_tokens"] = torch.cat([
            kw["num_rejected_tokens"].to(torch.int64) if kw.get("num_rejected_tokens") is not None
            else torch.zeros(kw["next_token_ids"].shape[0], dtype=torch.int64) for kw in kws])
    if any(kw.get("token_indices_to_sample") is not None for kw in kws):
        fused["token_indices_to_sample"] = torch.cat([
            (kw["token_indices_to_sample"].to(torch.int64) if kw.get("token_indices_to_sample") is not None
             else _default_sample_indices(kw)) + off for kw, off in zip(kws, token_offsets)])
    if any(kw.get("temperatures") is not None for kw in kws):
        fused["temperatures"] = torch.cat([
            kw["temperatures"].to(torch.float32) if kw.get("temperatures") is not None
            else torch.zeros(kw["next_token_ids"].shape[0], dtype=torch.float32) for kw in kws])
    return fused, rows


class EngineRunner:
    """The worker-thread side: validate each request, fuse what fits, run, split."""

    def __init__(self, engine, on_engine_call=None):
        self.engine = engine
        cfg = engine.config
        self.max_batch = cfg.max_num_seqs
        self.max_tokens = cfg.max_num_batched_tokens
        self.hidden_dtype = cfg.torch_dtype
        self.on_engine_call = on_engine_call or (lambda ec: None)
        self.busy_since: float | None = None  # for the liveness check

    def run(self, items: list[Pending]) -> list:
        self.busy_since = time.monotonic()
        try:
            return self._run(items)
        finally:
            self.busy_since = None

    def _run(self, items: list[Pending]) -> list:
        for it in items:
            if it.call.probe is not None:
                it.call.probe.mark("handoff_in")
        results: list = [None] * len(items)
        ready: list[tuple[int, dict]] = []
        now = time.monotonic()
        # Alone in its engine call, a request needs no check of its own: engine.propose validates
        # everything before it writes anything, and its error can only be this request's.
        alone = len(items) == 1 and not (items[0].call.batch_padded or items[0].call.tokens_padded)
        for i, it in enumerate(items):
            if it.future.cancelled():
                results[i] = DrafterError(Code.DEADLINE_EXCEEDED, "", "cancelled by the client")
            elif not it.session.alive:
                results[i] = DrafterError(Code.NOT_FOUND, "session_id", "the session was detached")
            elif it.call.deadline is not None and now > it.call.deadline:
                results[i] = DrafterError(Code.DEADLINE_EXCEEDED, "", "deadline passed before the engine was free")
            else:
                try:
                    kw = offset_kwargs(it.session, it.call.kwargs)
                    _check_finite(kw)  # first in both paths, so a request's error never depends on its batch
                    if not alone:
                        _engine_validate(self.engine, kw)
                    ready.append((i, kw))
                except Exception as exc:  # noqa: BLE001 - every failure becomes that request's answer
                    results[i] = from_exception(exc)
        for group in self._plan(items, ready):
            self._run_group(items, group, results)
        return results

    def _plan(self, items, ready) -> list[list[tuple[int, dict]]]:
        """Greedy packing up to the engine's limits; agreed padded sizes (DP) run alone."""
        groups, current, b, n = [], [], 0, 0
        for i, kw in ready:
            call = items[i].call
            if call.batch_padded or call.tokens_padded:
                groups.append([(i, kw)])
                continue
            cb, cn = call.batch_size, call.num_tokens
            if current and (b + cb > self.max_batch or n + cn > self.max_tokens):
                groups.append(current)
                current, b, n = [], 0, 0
            current.append((i, kw))
            b, n = b + cb, n + cn
        if current:
            groups.append(current)
        return groups

    def _run_group(self, items, group, results) -> None:
        calls = [items[i].call for i, _ in group]
        try:
            if len(group) == 1:
                kw, rows = group[0][1], [(0, calls[0].batch_size)]
            else:
                kw, rows = fuse([kw for _, kw in group], [items[i].session.bases for i, _ in group],
                                self.hidden_dtype)
            for c in calls:
                if c.probe is not None:
                    c.probe.mark("prepare")
            t0 = time.perf_counter()
            out = self.engine.propose(
                **kw, return_probs=any(c.return_probs for c in calls),
                batch_padded=calls[0].batch_padded or None, tokens_padded=calls[0].tokens_padded or None)
            seconds = time.perf_counter() - t0
            for c in calls:
                if c.probe is not None:
                    c.probe.mark("engine")
        except Exception as exc:  # noqa: BLE001
            if len(group) > 1:  # should not happen after per-request validation; keep the others safe
                log.error("fused engine call failed (%s); running its %d requests one by one", exc, len(group))
                for member in group:
                    self._run_group(items, [member], results)
                return
            results[group[0][0]] = from_exception(exc)
            return
        self.on_engine_call(EngineCall(
            requests=len(group), sessions=len({items[i].session.id for i, _ in group}),
            batch=sum(c.batch_size for c in calls), batch_padded=out.batch_padded,
            tokens=sum(c.num_tokens for c in calls), tokens_padded=out.tokens_padded, seconds=seconds))
        for (i, _), call, (r0, r1) in zip(group, calls, rows):
            probs = out.draft_probs[r0:r1] if call.return_probs and out.draft_probs is not None else None
            results[i] = ProposeResult(call.request_id, out.draft_token_ids[r0:r1], probs, out.batch_padded,
                                       out.tokens_padded, {"engine_s": seconds})


class Batcher:
    """Collect requests for up to `window_s` after the first one, then hand them to the worker."""

    def __init__(self, runner: EngineRunner, executor: concurrent.futures.Executor, window_s: float):
        self.runner = runner
        self.executor = executor
        self.window_s = window_s
        self.queue: asyncio.Queue[Pending] = asyncio.Queue()
        self._carry: Pending | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def submit(self, session: Session, call: ProposeCall) -> ProposeResult:
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put(Pending(session, call, fut))
        return await fut

    def _fits(self, items: list[Pending], it: Pending) -> bool:
        b = sum(x.call.batch_size for x in items) + it.call.batch_size
        n = sum(x.call.num_tokens for x in items) + it.call.num_tokens
        return b <= self.runner.max_batch and n <= self.runner.max_tokens

    async def _collect(self) -> list[Pending]:
        first = self._carry or await self.queue.get()
        self._carry = None
        items = [first]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.window_s
        while True:
            if self.queue.empty():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    it = await asyncio.wait_for(self.queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
            else:
                it = self.queue.get_nowait()
            if not self._fits(items, it):
                self._carry = it  # first in line for the next engine call
                break
            items.append(it)
            if sum(x.call.batch_size for x in items) >= self.runner.max_batch:
                break  # full: waiting longer cannot add anything
        return items

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = await self._collect()
            try:
                results = await loop.run_in_executor(self.executor, self.runner.run, items)
            except Exception as exc:  # noqa: BLE001 - the worker itself failed; answer everyone
                results = [from_exception(exc)] * len(items)
            for it, r in zip(items, results):
                if it.future.done():
                    continue
                if isinstance(r, BaseException):
                    it.future.set_exception(r)
                else:
                    it.future.set_result(r)
