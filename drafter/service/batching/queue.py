"""The engine's one thread and the queue in front of it: requests wait here for a batch window,
plain jobs (loading, wiping a detached session's blocks) keep their place in arrival order.

Requests that arrived before a job but did not fit into the batch before it wait in the Batcher's
FairQueue (one FIFO per client, served round-robin: fair.py) and run after the job: a job never
waits for a backlog, and each client's own requests keep their order."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from drafter.service.batching.deliver import deliver_from_thread
from drafter.service.batching.fair import FairQueue
from drafter.service.engine_lock import EngineLock
from drafter.service.sessions import Session
from drafter.wire.errors import Code, DrafterError, from_exception
from drafter.wire.records import ProposeRequest, ProposeResult

if TYPE_CHECKING:
    from drafter.service.batching.runner import EngineRunner

log = logging.getLogger("drafter.service.batching")


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
    client: str = ""  # whose request it is, for fair queueing (Caller.client; "": unknown, one shared FIFO)
    push: Callable | None = None  # called in the ENGINE thread with the call's PreDrafts, after the replies


_STOP = object()
_WAKE = object()  # wakes the engine thread to answer a stopped Batcher's backlog


@dataclass
class _Job:
    future: concurrent.futures.Future
    fn: Callable
    args: tuple
    kwargs: dict


class EngineThread(concurrent.futures.Executor):
    """The engine's one thread: plain jobs (submit) and propose requests (post), in arrival order.

    A concurrent.futures.Executor, so `loop.run_in_executor(engine_thread, fn)` works for the
    jobs; requests are batched by the Batcher attached to it (Batcher.start)."""

    def __init__(self, name: str = "engine"):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._shutdown = False
        self.batcher: Batcher | None = None
        self._retired: list[Batcher] = []  # stopped Batchers whose backlog the engine thread still answers
        # held while a job or a batch runs: a bound session's data thread takes it to run its step
        # on its own thread (drafter.service.bound_ipc), without a hop to this one and back
        self.engine_lock = EngineLock()  # drains an armed binding's step queued ahead (drafter.service.engine_lock)
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

    def retire(self, batcher: Batcher) -> None:
        """The batcher stopped: its backlog (engine-thread state) is answered UNAVAILABLE in the engine
        thread, before anything else it does, also when shutdown(cancel_futures=True) drops the queue."""
        if self.batcher is batcher:
            self.batcher = None
        self._retired.append(batcher)
        self._q.put(_WAKE)

    def _answer_retired(self) -> None:
        while self._retired:
            self._retired.pop().abandon_backlog()

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
            self._answer_retired()
            batcher = self.batcher
            if carry is None and batcher is not None and batcher.fair:  # a backlog: the next batch at once
                items, carry = batcher.collect(None, self._q)
                with self.engine_lock:
                    batcher.answer_batch(items)
                continue
            item = carry if carry is not None else self._q.get()
            carry = None
            if item is _STOP:
                if self.batcher is not None:
                    self.batcher.abandon_backlog()
                self._answer_retired()
                self._drain_queue()
                return
            if item is _WAKE:
                continue
            if isinstance(item, _Job):
                if item.future.set_running_or_notify_cancel():
                    try:
                        with self.engine_lock:
                            result = item.fn(*item.args, **item.kwargs)
                        item.future.set_result(result)
                    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                        item.future.set_exception(exc)
                continue
            batcher = self.batcher
            if batcher is None:  # stopped: nobody runs requests any more
                _abandon([item])
                continue
            items, carry = batcher.collect(item, self._q)
            with self.engine_lock:
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


def _client_of(call: ProposeRequest) -> str:
    return call.caller.client if call.caller is not None else ""


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
        self.fair = FairQueue()  # requests collected but not run yet (engine thread only)

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
                self.executor.retire(self)  # the backlog is the engine thread's: answered there
        elif self._job is not None:
            self._own_queue.put(_STOP)
            await asyncio.wrap_future(self._job)
        self._post = None

    def abandon_backlog(self) -> None:
        """Engine thread: answer every collected request that has not run (UNAVAILABLE: shutting down)."""
        _abandon(self.fair.drain())

    def _serve(self, q: queue.SimpleQueue) -> None:  # the engine thread, for a plain executor
        carry = None
        while True:
            if carry is None and self.fair:
                items, carry = self.collect(None, q)
                self.answer_batch(items)
                continue
            item = carry if carry is not None else q.get()
            carry = None
            if item is _STOP:
                left = self.fair.drain()
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
        self._submit(Pending(session, call, fut, loop=loop, client=_client_of(call)))
        return await fut

    def submit_nowait(self, session: Session, call: ProposeRequest, on_done: Callable, reply: Callable | None = None,
                      push: Callable | None = None) -> None:
        """From the event loop: on_done(result or DrafterError) runs in this loop once the engine is done;
        reply(result), if given, runs in the engine thread before that, for successful results only;
        push(pre_drafts), if given, after every reply of the batch (drafter.service.predraft)."""
        self._submit(Pending(session, call, None, on_done=on_done, loop=asyncio.get_running_loop(), reply=reply,
                             client=_client_of(call), push=push))

    # ------------------------------------------------------------------ the engine thread
    def collect(self, first: Pending | None, q: queue.SimpleQueue) -> tuple[list[Pending], object]:
        """The next batch (`first` and the backlog joining it), and what to process next (a job, stop,
        or None).  Everything already queued up to the next job joins the fair queue, so a client
        queued behind another's backlog is in this batch; waits only within the window, and not at
        all once a full engine call is waiting.  The batch is formed round-robin across clients."""
        fair, max_batch, max_tokens = self.fair, self.runner.max_batch, self.runner.max_tokens
        if first is not None:
            fair.push(first)
        deadline = time.monotonic() + self.window_s
        carry = None
        while True:
            remaining = deadline - time.monotonic()
            full = fair.rows >= max_batch or fair.tokens >= max_tokens  # waiting cannot add to this batch
            try:
                it = q.get_nowait() if remaining <= 0 or full else q.get(timeout=remaining)
            except queue.Empty:
                break
            if not isinstance(it, Pending):
                carry = it  # a job (or stop) keeps its place: after this batch
                break
            fair.push(it)
        return fair.take(max_batch, max_tokens), carry

    def answer_batch(self, items: list[Pending]) -> None:
        """Run one collected batch and answer every request of it: replies first, then their bookkeeping
        (delivered to the event loop), then the pre-drafts of calls that asked (after_batch)."""
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
        # each reply's bookkeeping goes to the event loop before any pre-draft runs: its completion
        # re-arms the connection (the ZMQ reader's kick), so a call arriving meanwhile is read at once
        deliver_from_thread(items, results)
        self.runner.flush_records()
        predrafts = getattr(self.runner, "predrafts", None)  # a runner without pre-drafting (test doubles)
        if predrafts is not None:
            predrafts.after_batch(items, results)  # pre-drafts only once every reply is out
