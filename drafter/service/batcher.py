"""Fused batching: requests of several sessions, collected within a window, run as ONE engine call.

Everything that touches the engine runs in one dedicated thread (EngineThread: the engine is not
thread-safe, and the event loop must stay free for the transports).  The event loop posts each
checked request straight into that thread's queue (no asyncio task or executor future between
them); the engine thread collects what arrives within the window, runs it, copies the drafts to
the host, and hands every result of the batch back with ONE loop.call_soon_threadsafe, whose
callback answers first (a ZMQ reply is sent from it) and does the bookkeeping after.  Plain jobs
(loading the engine, wiping a detached session's blocks) run on the same thread, in arrival order.

In the engine thread each request is checked on its own first (session still alive, deadline,
finite hidden states, the engine's full validation of its shifted block ids), so a bad one is
refused alone and never reaches the fused call; the good ones are concatenated, padded to
common block-table widths, run, and their drafts split back.  On a GPU the hidden states are
staged through one pinned host buffer that the engine thread reuses (never pinned per call), so
their host-to-device copy is a real asynchronous DMA.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from drafter.inputs import validate
from drafter.service.sessions import Session, offset_inputs
from drafter.wire.cuda_ref import FIELD as IPC_FIELD
from drafter.wire.errors import Code, DrafterError, from_exception, invalid
from drafter.wire.records import INPUT_FIELDS, ProposeInputs, ProposeRequest, ProposeResult

log = logging.getLogger("drafter.service.batcher")


@dataclass
class Pending:
    session: Session
    call: ProposeRequest
    future: asyncio.Future | concurrent.futures.Future | None  # None: on_done is called instead
    enqueued: float = field(default_factory=time.monotonic)
    on_done: Callable | None = None  # called in the event loop with the ProposeResult or the DrafterError
    loop: asyncio.AbstractEventLoop | None = None  # where the result goes
    reply: Callable | None = None  # called in the ENGINE thread with a ProposeResult, before on_done: a
    # transport that can answer from there (ZMQ) does so at once, with no hop through the event loop


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


def _engine_validate(engine, inp: ProposeInputs) -> None:
    validate(inp, engine.limits)


# float dtype -> (signed and unsigned integer views, exponent bits, sign bit).  A value is NaN or inf
# exactly when all its exponent bits are set, i.e. when its bits lie in [exp, sign - 1] (positive) or
# [sign | exp, all ones] (negative): the top of the signed and of the unsigned range.  So two
# read-only max() passes decide it, with no temporary array.
_EXPONENT = {torch.bfloat16: (torch.int16, np.uint16, 0x7F80, 0x8000),
             torch.float16: (torch.int16, np.uint16, 0x7C00, 0x8000),
             torch.float32: (torch.int32, np.uint32, 0x7F800000, 0x80000000)}


def all_finite(t: torch.Tensor) -> bool:
    """True when no element is NaN or inf.  On the CPU two vectorised read-only passes over the
    bits (bf16 torch.isfinite runs element by element: ~40x slower on a 1.5 MB hidden-state batch)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    spec = _EXPONENT.get(t.dtype)
    if t.device.type != "cpu" or spec is None:
        return bool(torch.isfinite(t).all())
    signed, unsigned, exp, sign = spec
    bits = t.detach().view(signed).numpy()  # same-size views: any strides, no copy
    return int(bits.max()) < exp and int(bits.view(unsigned).max()) < (sign | exp)


def _check_finite(inp: ProposeInputs, name: str = "target_hidden_states") -> None:
    # NaN/inf would only poison the sender's own KV, but a drafter should say so rather than draft garbage.
    # (A CUDA IPC tensor is checked on the GPU: one reduction, one flag read back, before any KV write.)
    if not all_finite(inp.target_hidden_states):
        raise invalid(name, "must be finite")


def _bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16 as its int16 bits), any strides."""
    if t.requires_grad:
        t = t.detach()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _cpu_bits(v) -> np.ndarray | None:
    """What HostStager copies of a call's value: a CPU tensor's bits; None: passed through as it is."""
    return _bits(v) if isinstance(v, torch.Tensor) and v.is_cpu else None


LIST_INPUTS = ("block_tables", "slot_mappings")  # one tensor per KV group
SINGLE_INPUTS = tuple(n for n in INPUT_FIELDS if n not in LIST_INPUTS)


class HostStager:
    """One reusable host buffer the engine thread copies a call's tensors into (pinned for a GPU).

    Pinned memory is mapped into the GPU's address space: the engine's captured loader reads a
    staged call in place (no copy launches, no synchronous pageable copies), and a copy from it
    is an asynchronous DMA.  It is allocated once (grown geometrically, up to the largest call
    the engine accepts) and reused by every call: the engine thread runs one call at a time and
    waits for its drafts on the host before the next, so the GPU has read the buffer by then.
    """

    def __init__(self, max_bytes: int, pin: bool = True):
        self.max_bytes = max_bytes
        self.pin = pin
        self.buf: torch.Tensor | None = None
        self.buf_np: np.ndarray | None = None  # the same bytes: numpy slices cost a fraction of torch's
        self.views: dict[np.dtype, np.ndarray] = {}  # buf_np as each dtype staged so far
        self.allocations = 0
        self.last: ProposeInputs | None = None  # what the buffer holds now

    def stage(self, inp: ProposeInputs) -> ProposeInputs:
        """inp with every CPU tensor (lists of them too) replaced by a copy in the buffer, each at a
        64-byte boundary; inp unchanged where it does not fit (the engine refuses such calls anyway)
        or is what the buffer holds already."""
        if inp is self.last:
            return inp
        singles = {n: _cpu_bits(getattr(inp, n)) for n in SINGLE_INPUTS}
        lists = {n: [_cpu_bits(t) for t in getattr(inp, n) or ()] for n in LIST_INPUTS}
        arrays = [a for a in (*singles.values(), *(a for v in lists.values() for a in v)) if a is not None]
        nbytes = sum(_aligned(a.nbytes) for a in arrays)
        if not arrays or nbytes > self.max_bytes:
            return inp
        self._reserve(nbytes)
        changes, offset = {}, 0
        for name, a in singles.items():
            if a is not None:
                changes[name], offset = self._place(a, getattr(inp, name).dtype, offset)
        for name, parts in lists.items():
            if not parts:
                continue
            staged = changes[name] = list(getattr(inp, name))
            for i, a in enumerate(parts):
                if a is not None:
                    staged[i], offset = self._place(a, staged[i].dtype, offset)
        self.last = replace(inp, **changes)
        return self.last

    def _reserve(self, nbytes: int) -> None:
        if self.buf is not None and self.buf.numel() >= nbytes:
            return
        size = min(self.max_bytes, max(nbytes, 2 * (self.buf.numel() if self.buf is not None else 0)))
        self.buf = torch.empty(_aligned(size), dtype=torch.uint8, pin_memory=self.pin)  # any dtype can view it
        self.buf_np, self.views = self.buf.numpy(), {}
        self.allocations += 1

    def _place(self, src: np.ndarray, dtype: torch.dtype, offset: int) -> tuple[torch.Tensor, int]:
        """src copied into the buffer at byte `offset`, as a tensor of `dtype`; and the next free offset."""
        view = self.views.get(src.dtype)
        if view is None:
            view = self.views[src.dtype] = self.buf_np.view(src.dtype)
        start = offset // src.itemsize
        dst = view[start:start + src.size]
        if src.ndim != 1:
            dst = dst.reshape(src.shape)
        dst[...] = src  # numpy's copy: several times torch's copy_ for bf16 (and cheaper to call than np.copyto)
        staged = torch.from_numpy(dst)
        return staged.view(torch.bfloat16) if dtype == torch.bfloat16 else staged, offset + _aligned(src.nbytes)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _default_sample_indices(inp: ProposeInputs) -> torch.Tensor:  # [batch] int64, the engine's own default
    idx = inp.query_start_loc[1:].long() - 1
    if inp.num_rejected_tokens is not None:
        idx = idx - inp.num_rejected_tokens.long()
    return idx


def fuse(parts: list[ProposeInputs], pads: list[tuple[int, ...]], hidden_dtype: torch.dtype
         ) -> tuple[ProposeInputs, list[tuple[int, int]]]:
    """Concatenate validated, already shifted requests into one engine call.

    pads[i][g]: a block id inside request i's own range, used to widen its block tables (the
    extra columns lie past every position it can reach, so they are never read or written).
    Returns the fused inputs and each request's rows [start, end) of the drafts.
    """
    token_offsets, rows, t, b = [], [], 0, 0
    for p in parts:
        token_offsets.append(t)
        rows.append((b, b + p.batch_size))
        t, b = t + p.num_tokens, b + p.batch_size
    ints = lambda ts: torch.cat([x.to(torch.int64) for x in ts])  # noqa: E731
    qsl = [torch.zeros(1, dtype=torch.int64)] + [p.query_start_loc[1:].to(torch.int64) + off
                                                 for p, off in zip(parts, token_offsets)]
    hidden = [p.target_hidden_states for p in parts]
    # shared (CUDA IPC) states live on the GPU: a batch that has any is concatenated there
    device = next((h.device for h in hidden if h.device.type != "cpu"), hidden[0].device)
    groups = range(len(pads[0]))
    return ProposeInputs(
        target_token_ids=ints([p.target_token_ids for p in parts]),
        target_positions=ints([p.target_positions for p in parts]),
        target_hidden_states=torch.cat([h.to(device, hidden_dtype) for h in hidden]),
        next_token_ids=ints([p.next_token_ids for p in parts]),
        query_start_loc=torch.cat(qsl),
        seq_lens=ints([p.seq_lens for p in parts]),
        block_tables=[_widened_tables(parts, pads, g) for g in groups],
        slot_mappings=[torch.cat([p.slot_mappings[g] for p in parts]) for g in groups],
        token_indices_to_sample=_fused_sample_indices(parts, token_offsets),
        num_rejected_tokens=_fused_optional(parts, lambda p: p.num_rejected_tokens, torch.int64),
        temperatures=_fused_optional(parts, lambda p: p.temperatures, torch.float32),
    ), rows


def _widened_tables(parts: list[ProposeInputs], pads, g: int) -> torch.Tensor:  # [batch, width] int
    width = max(p.block_tables[g].shape[1] for p in parts)
    out = []
    for p, pad in zip(parts, pads):
        tb = p.block_tables[g]
        if tb.shape[1] < width:
            tb = torch.cat([tb, torch.full((tb.shape[0], width - tb.shape[1]), pad[g], dtype=tb.dtype)], 1)
        out.append(tb)
    return torch.cat(out)


def _fused_optional(parts: list[ProposeInputs], get, dtype: torch.dtype) -> torch.Tensor | None:  # [batch]
    """A per-request optional tensor across the batch; zeros (the engine's default) where a request has none."""
    if all(get(p) is None for p in parts):
        return None
    return torch.cat([get(p).to(dtype) if get(p) is not None else torch.zeros(p.batch_size, dtype=dtype)
                      for p in parts])


def _fused_sample_indices(parts: list[ProposeInputs], token_offsets: list[int]) -> torch.Tensor | None:  # [batch]
    if all(p.token_indices_to_sample is None for p in parts):
        return None
    return torch.cat([(p.token_indices_to_sample.to(torch.int64) if p.token_indices_to_sample is not None
                       else _default_sample_indices(p)) + off for p, off in zip(parts, token_offsets)])


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

    def _run(self, items: list[Pending]) -> list:
        for it in items:
            if it.call.probe is not None:
                it.call.probe.mark("handoff_in")
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
        call = it.call
        inp = offset_inputs(it.session, call.inputs)
        if call.probe is not None:
            call.probe.mark("session_offsets")
        if call.hidden_ipc is not None:
            inp = replace(inp, target_hidden_states=self._shared_hidden(it))
            if call.probe is not None:
                call.probe.mark("ipc_open")
        if alone and self.stager is not None:
            # staged here rather than in _run_group (which passes the staged inputs on): the finite check
            # below then reads the staged copy while it is still in cache, not the message again
            inp = self.stager.stage(inp)
        # first in both paths (alone or fused), so a request's error never depends on its batch
        _check_finite(inp, IPC_FIELD if call.hidden_ipc is not None else "target_hidden_states")
        if call.probe is not None:
            call.probe.mark("finite_check")
        if not alone:
            _engine_validate(self.engine, inp)
        return inp

    def _shared_hidden(self, it: Pending) -> torch.Tensor:  # [num_tokens, hidden_width] on the GPU
        if self.cuda_ipc is None:  # ServiceCore.check refuses these first; kept for direct callers
            raise invalid(IPC_FIELD, "this drafter does not open CUDA IPC references")
        return self.cuda_ipc.tensor(it.session.id, it.call.hidden_ipc)

    def forget_session(self, session_id: str) -> None:
        """Engine thread: release what the session opened (CUDA IPC storages and events)."""
        if self.cuda_ipc is not None:
            self.cuda_ipc.forget(session_id)

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

    def _run_group(self, items, group, results) -> None:
        calls = [items[i].call for i, _ in group]
        try:
            if len(group) == 1:
                inp, rows = group[0][1], [(0, calls[0].batch_size)]
            else:
                inp, rows = fuse([part for _, part in group], [items[i].session.bases for i, _ in group],
                                 self.hidden_dtype)
            if self.stager is not None:
                inp = self.stager.stage(inp)
            for c in calls:
                if c.probe is not None:
                    c.probe.mark("prepare")
            t0 = time.perf_counter()
            out = self.engine.draft(
                inp, return_probs=any(c.return_probs for c in calls),
                batch_padded=calls[0].batch_padded or None, tokens_padded=calls[0].tokens_padded or None)
            # the drafts on the host here, in the engine thread: the event loop never waits on the GPU,
            # and the staged inputs have been read before the next call overwrites them
            drafts = out.draft_token_ids.cpu()
            probs = out.draft_probs.cpu() if out.draft_probs is not None else None
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
        record = EngineCall(
            requests=len(group), sessions=len({items[i].session.id for i, _ in group}),
            batch=sum(c.batch_size for c in calls), batch_padded=out.batch_padded,
            tokens=sum(c.num_tokens for c in calls), tokens_padded=out.tokens_padded, seconds=seconds)
        if self.defer_records:
            self.deferred.append(record)
        else:
            self.on_engine_call(record)
        for (i, _), call, (r0, r1) in zip(group, calls, rows):
            p = probs[r0:r1] if call.return_probs and probs is not None else None
            results[i] = ProposeResult(call.request_id, drafts[r0:r1], p, out.batch_padded, out.tokens_padded,
                                       {"engine_s": seconds})


_STOP = object()


@dataclass
class _Job:
    future: concurrent.futures.Future
    fn: Callable
    args: tuple
    kwargs: dict


def _deliver(items: list[Pending], results: list) -> None:
    """In the event loop: every result of one engine batch, replies first."""
    for it, r in zip(items, results):
        if it.on_done is not None:
            try:
                it.on_done(r)
            except Exception:  # noqa: BLE001 - one transport's bug must not cost the others their answers
                log.exception("propose completion failed")
        elif not it.future.done():
            if isinstance(r, BaseException):
                it.future.set_exception(r)
            else:
                it.future.set_result(r)


def deliver_from_thread(items: list[Pending], results: list) -> None:
    """Engine thread -> event loop(s): one wake-up per loop for the whole batch."""
    by_loop: dict = {}
    for it, r in zip(items, results):
        if it.loop is None:  # a concurrent.futures future: settle it right here
            if not it.future.done():
                if isinstance(r, BaseException):
                    it.future.set_exception(r)
                else:
                    it.future.set_result(r)
            continue
        its, rs = by_loop.setdefault(it.loop, ([], []))
        its.append(it)
        rs.append(r)
    for loop, (its, rs) in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, its, rs)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


class EngineThread(concurrent.futures.Executor):
    """The engine's one thread: plain jobs (submit) and propose requests (post), in arrival order.

    A concurrent.futures.Executor, so `loop.run_in_executor(engine_thread, fn)` works for the
    jobs; requests are batched by the Batcher attached to it (Batcher.start)."""

    def __init__(self, name: str = "engine"):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._shutdown = False
        self.batcher: Batcher | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        f: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put(_Job(f, fn, args, kwargs))
        return f

    def post(self, item: Pending) -> None:
        self._q.put(item)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if not self._shutdown:
            self._shutdown = True
            if cancel_futures:
                self._drain_queue()
            self._q.put(_STOP)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _drain_queue(self) -> None:
        left = []
        while True:
            try:
                left.append(self._q.get_nowait())
            except queue.Empty:
                break
        _abandon(left)

    def _main(self) -> None:
        carry = None
        while True:
            item = carry if carry is not None else self._q.get()
            carry = None
            if item is _STOP:
                self._drain_queue()
                return
            if isinstance(item, _Job):
                if item.future.set_running_or_notify_cancel():
                    try:
                        item.future.set_result(item.fn(*item.args, **item.kwargs))
                    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                        item.future.set_exception(exc)
                continue
            batcher = self.batcher
            if batcher is None:  # stopped: nobody runs requests any more
                _abandon([item])
                continue
            items, carry = batcher.collect(item, self._q)
            batcher.answer_batch(items)


def _abandon(items: list) -> None:
    pendings = []
    for it in items:
        if isinstance(it, _Job):
            it.future.cancel()
        elif isinstance(it, Pending):
            pendings.append(it)
    if pendings:
        deliver_from_thread(pendings, [DrafterError(Code.UNAVAILABLE, "", "the drafter is shutting down")]
                            * len(pendings))


class Batcher:
    """Collect requests for up to `window_s` after the first one, then run them as one batch.

    executor: the engine's thread.  An EngineThread multiplexes these requests with its plain
    jobs; any other executor must be a single thread dedicated to the engine, which the
    collecting loop then occupies until stop()."""

    def __init__(self, runner: EngineRunner, executor: concurrent.futures.Executor, window_s: float):
        self.runner = runner
        self.executor = executor
        self.window_s = window_s
        self._post: Callable | None = None
        self._own_queue: queue.SimpleQueue | None = None
        self._job: concurrent.futures.Future | None = None

    def start(self) -> None:
        self.runner.defer_records = True  # metrics after the replies (answer_batch flushes them)
        if isinstance(self.executor, EngineThread):
            self.executor.batcher = self
            self._post = self.executor.post
        else:
            self._own_queue = queue.SimpleQueue()
            self._post = self._own_queue.put
            self._job = self.executor.submit(self._serve, self._own_queue)

    async def stop(self) -> None:
        if isinstance(self.executor, EngineThread):
            if self.executor.batcher is self:
                self.executor.batcher = None
        elif self._job is not None:
            self._own_queue.put(_STOP)
            await asyncio.wrap_future(self._job)
        self._post = None

    def _serve(self, q: queue.SimpleQueue) -> None:  # the engine thread, for a plain executor
        carry = None
        while True:
            item = carry if carry is not None else q.get()
            carry = None
            if item is _STOP:
                left = []
                while True:
                    try:
                        left.append(q.get_nowait())
                    except queue.Empty:
                        break
                _abandon(left)
                return
            items, carry = self.collect(item, q)
            self.answer_batch(items)

    def _submit(self, item: Pending) -> None:
        if self._post is None:
            raise DrafterError(Code.UNAVAILABLE, "", "the drafter is shutting down")
        self._post(item)

    async def submit(self, session: Session, call: ProposeRequest) -> ProposeResult:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._submit(Pending(session, call, fut, loop=loop))
        return await fut

    def submit_nowait(self, session: Session, call: ProposeRequest, on_done: Callable, reply: Callable | None = None
                      ) -> None:
        """From the event loop: on_done(result or DrafterError) runs in this loop once the engine is done;
        reply(result), if given, runs in the engine thread before that, for successful results only."""
        self._submit(Pending(session, call, None, on_done=on_done, loop=asyncio.get_running_loop(), reply=reply))

    # ------------------------------------------------------------------ the engine thread
    def collect(self, first: Pending, q: queue.SimpleQueue) -> tuple[list[Pending], object]:
        """The batch that starts with `first`, and what to process next (a request that did not
        fit, a job, or None).  Takes everything already queued; waits only within the window."""
        items = [first]
        b, n = first.call.batch_size, first.call.num_tokens
        deadline = time.monotonic() + self.window_s
        while b < self.runner.max_batch:  # full: waiting longer cannot add anything
            remaining = deadline - time.monotonic()
            try:
                it = q.get_nowait() if remaining <= 0 else q.get(timeout=remaining)
            except queue.Empty:
                break
            if not isinstance(it, Pending):
                return items, it  # a job (or stop) keeps its place: after this batch
            cb, cn = it.call.batch_size, it.call.num_tokens
            if b + cb > self.runner.max_batch or n + cn > self.runner.max_tokens:
                return items, it  # first in line for the next engine call
            items.append(it)
            b, n = b + cb, n + cn
        return items, None

    def answer_batch(self, items: list[Pending]) -> None:
        """Run one collected batch and answer every request of it (replies first, then bookkeeping)."""
        try:
            results = self.runner.run_batch(items)
        except Exception as exc:  # noqa: BLE001 - the worker itself failed; answer everyone
            results = [from_exception(exc)] * len(items)
        for it, r in zip(items, results):
            if it.reply is not None and not isinstance(r, BaseException):
                try:
                    it.reply(r)
                except Exception:  # noqa: BLE001 - on_done still runs and answers what was not sent
                    log.exception("reply from the engine thread failed")
        deliver_from_thread(items, results)
        self.runner.flush_records()
