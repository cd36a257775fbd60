"""The service core behind both transports: attach / propose / detach / info, states and draining.

Order of checks for a propose call (nothing reaches the engine before all of them passed):
wire decode (by the transport) -> epoch (FAILED_PRECONDITION) and session (NOT_FOUND) -> the
session's limits (sessions.check_call) -> the engine's own validation, request by request, in
the engine thread (batcher.EngineRunner).  A stale epoch is checked first because it tells the
client the most: the drafter restarted, every session is gone, attach again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch

from drafter.service import cuda_support
from drafter.wire import schema
from drafter.service.batching.queue import Batcher, EngineThread
from drafter.service.batching.runner import EngineRunner
from drafter.wire.cuda_ref import FIELD as IPC_FIELD
from drafter.wire.errors import Code, DrafterError, from_exception, invalid
from drafter.service.logs import RefusalLog, session_tag
from drafter.service.metrics import Metrics, accepted_from_report
from drafter.service.sessions import (PROTOCOL_VERSION, ClientQuotas, EngineDescription, Session, SessionTable,
                                      check_call)
from drafter.wire.records import Caller, ProposeRequest, ProposeResult

log = logging.getLogger("drafter.service")
VERSION = "0.1.0"

LOADING, SERVING, DRAINING = "loading", "serving", "draining"


def describe_engine(engine, max_message_bytes: int) -> EngineDescription:
    cfg, spec = engine.config, engine.spec
    aux = tuple(spec.aux_layer_ids) if cfg.method in ("eagle3", "extract_hidden_states") else ()
    return EngineDescription(
        method=cfg.method, num_speculative_tokens=cfg.num_speculative_tokens,
        speculative_token_tree=cfg.speculative_token_tree, dtype=cfg.dtype, hidden_size=spec.target_width,
        num_aux_layers=len(aux), aux_layer_ids=aux, hidden_width=spec.hidden_input_width,
        vocab_size=spec.vocab_size, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens, block_sizes=tuple(g.block_size for g in cfg.kv_groups),
        pool_blocks=tuple(g.num_blocks for g in cfg.kv_groups), capture_sizes=tuple(cfg.capture_sizes),
        token_capture_sizes=tuple(cfg.token_capture_sizes), max_message_bytes=max_message_bytes,
        mtp_layer_schedule=cfg.mtp_layer_schedule,
        predraft_tokens=cfg.predraft_tokens if cfg.predraft_outcomes and cfg.predraft_k > cfg.num_speculative_tokens
        else 0)


def release_session(engine, runner: EngineRunner, s: Session) -> None:
    """Runs in the engine thread: wipe the session's blocks, close what it shared with us."""
    runner.forget_session(s.id)
    zero_session_blocks(engine, s)


def zero_session_blocks(engine, s: Session) -> None:
    """Runs in the engine thread: wipe what a released session left in its blocks."""
    for g, (base, n) in enumerate(zip(s.bases, s.num_blocks)):
        ids = torch.arange(base, base + n)
        if engine.kv is not None:
            engine.kv.zero_blocks(g, ids)
        elif engine.store is not None:
            engine.store.states[ids.to(engine.store.states.device)] = 0


@dataclass
class CallRecord:
    transport: str
    rpc: str
    t0: float
    client: str = ""  # Caller.client: whose in-flight count this call holds


class InflightLimit:
    """Calls queued or running per client (Caller.client), capped: past the cap a call is refused at
    once (RESOURCE_EXHAUSTED), so no client can queue without bound or fill the transports' shared
    in-flight room.  limit 0: no cap (calls are still counted)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.calls: dict[str, int] = {}

    def enter(self, client: str) -> None:
        n = self.calls.get(client, 0)
        if self.limit and n >= self.limit:
            raise DrafterError(Code.RESOURCE_EXHAUSTED, "",
                               f"this client has {n} calls queued or running, the most allowed "
                               f"(--max-inflight-per-client {self.limit}); wait for replies before sending more")
        self.calls[client] = n + 1

    def leave(self, client: str) -> None:
        n = self.calls.get(client, 0) - 1
        if n > 0:
            self.calls[client] = n
        else:
            self.calls.pop(client, None)


class CallAccounting:
    """What the transports wrap each call in, on whatever counts calls (ServiceCore in the serving
    process, drafter.service.front.FrontCore in a front process): their begin() and finish()."""

    @asynccontextmanager
    async def serving(self, transport: str, rpc: str, caller: Caller | None = None):
        """Wrap one call: refuse unless serving, count it in flight, record its outcome.

        Raises DrafterError (UNAVAILABLE while loading or draining, RESOURCE_EXHAUSTED past the
        caller's in-flight cap); any other failure inside comes out as a DrafterError too, so
        transports only ever see DrafterError.
        """
        rec = self.begin(transport, rpc, caller)
        try:
            yield
        except BaseException as exc:
            err = self.finish(rec, exc)
            if err is not None:
                raise err from (None if err is exc else exc)
            raise
        else:
            self.finish(rec)


class ServiceCore(CallAccounting):
    def __init__(self, *, metrics: Metrics, max_sessions: int, batch_window_s: float, max_message_bytes: int,
                 session_idle_timeout_s: float = 0.0, allow_cuda_ipc: tuple[bool, str] = (False, "not enabled"),
                 quotas: ClientQuotas = ClientQuotas()):
        """allow_cuda_ipc: (allowed, why not) from drafter.service.cuda_support.allowed; the engine's
        device decides the rest.  quotas: what one client (Caller.client) may hold and have in flight."""
        self.metrics = metrics
        self.allow_cuda_ipc = allow_cuda_ipc
        self.cuda_ipc = schema.CudaIpcSupport(enabled=False, reason="loading")
        self.max_sessions = max_sessions
        self.quotas = quotas
        self.client_calls = InflightLimit(quotas.max_inflight)
        self.batch_window_s = batch_window_s
        self.max_message_bytes = max_message_bytes
        self.session_idle_timeout_s = session_idle_timeout_s
        self.epoch = secrets.randbits(64)  # a new one per process: clients notice restarts
        self.state = LOADING
        self.executor = EngineThread("engine")  # the engine's one thread: load, batches, block wipes
        self.engine = None
        self.desc: EngineDescription | None = None
        self.sessions: SessionTable | None = None
        self.runner: EngineRunner | None = None
        self.batcher: Batcher | None = None
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._janitor: asyncio.Task | None = None
        self._graph_replays = 0
        self._refusals = RefusalLog()

    # ------------------------------------------------------------------ lifecycle
    async def load(self, loader) -> None:
        """Build the engine in the engine thread (CUDA state belongs to that thread), then serve."""
        engine = await asyncio.get_running_loop().run_in_executor(self.executor, loader)
        self.set_engine(engine)

    def set_engine(self, engine) -> None:
        self.engine = engine
        self.desc = describe_engine(engine, self.max_message_bytes)
        self.sessions = SessionTable(self.desc, self.max_sessions, self.quotas)
        self.cuda_ipc = cuda_support.advertise(getattr(engine, "device", "cpu"), *self.allow_cuda_ipc)
        self.runner = EngineRunner(engine, self._on_engine_call, self._cuda_ipc_opener(engine))
        self.runner.predrafts.on_record = self.metrics.record_predraft
        self.runner.predrafts.on_acceptance = self.metrics.record_predraft_acceptance
        self.runner.predrafts.on_skip = self.metrics.predraft_skipped.inc
        self.runner.predrafts.on_budget = self.metrics.record_predraft_budget
        self.runner.predrafts.busy = self._work_waiting
        self.batcher = Batcher(self.runner, self.executor, self.batch_window_s)
        self.batcher.start()
        if self.session_idle_timeout_s > 0:
            self._janitor = asyncio.get_running_loop().create_task(self._expire_idle(), name="session-janitor")
        self.metrics.method = self.desc.method
        self.metrics.info.info({"method": self.desc.method, "epoch": str(self.epoch), "version": VERSION,
                                "dtype": self.desc.dtype})
        self._update_gauges()
        self.state = SERVING
        self.metrics.state.set(1)

    def _cuda_ipc_opener(self, engine):
        log.info("cuda ipc", extra={"event": "cuda_ipc", "enabled": self.cuda_ipc.enabled,
                                    "reason": self.cuda_ipc.reason, "gpus": list(self.cuda_ipc.device_uuids)})
        if not self.cuda_ipc.enabled:
            return None
        from drafter.service.cuda_ipc import CudaIpcOpener

        return CudaIpcOpener(engine.device, self.cuda_ipc)

    def start_draining(self) -> None:
        if self.state != DRAINING:
            self.state = DRAINING
            self.metrics.state.set(0)

    async def wait_idle(self, timeout: float) -> bool:
        """True when no call is in flight any more (within timeout)."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()
        if self.batcher is not None:
            await self.batcher.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def engine_stalled(self, stall_s: float) -> bool:
        since = self.runner.busy_since if self.runner is not None else None
        return since is not None and time.monotonic() - since > stall_s

    # ------------------------------------------------------------------ accounting
    def begin(self, transport: str, rpc: str, caller: Caller | None = None) -> "CallRecord":
        """Start one call: refuse unless serving (UNAVAILABLE while loading or draining) and while the
        caller has its most calls in flight (RESOURCE_EXHAUSTED), count it in flight.  Every begin()
        that returns is closed by exactly one finish()."""
        if self.state != SERVING:
            self._count(transport, rpc, Code.UNAVAILABLE)
            raise DrafterError(Code.UNAVAILABLE, "", f"the drafter is {self.state}")
        client = caller.client if caller is not None else ""
        try:
            self.client_calls.enter(client)
        except DrafterError as err:
            self._count(transport, rpc, err.code)
            self._refusals.log(transport, rpc, err)
            raise
        self.inflight += 1
        self._idle.clear()
        self.metrics.inflight.labels(transport).inc()
        return CallRecord(transport, rpc, time.perf_counter(), client)

    def finish(self, rec: "CallRecord", exc: BaseException | None = None) -> DrafterError | None:
        """Close a call: record its outcome; returns the DrafterError its failure maps to (None: OK)."""
        err = None
        try:
            if exc is None:
                self._count(rec.transport, rec.rpc, Code.OK)
                if rec.rpc in ("Propose", "ProposeStream"):
                    self.metrics.latency.labels(rec.transport, rec.rpc).observe(time.perf_counter() - rec.t0)
            elif isinstance(exc, asyncio.CancelledError):
                self._count(rec.transport, rec.rpc, Code.DEADLINE_EXCEEDED)
            else:
                err = from_exception(exc)
                self._count(rec.transport, rec.rpc, err.code)
                if err.code == Code.INTERNAL:
                    log.error("internal error", exc_info=exc, extra={"event": "internal_error",
                                                                      "transport": rec.transport, "rpc": rec.rpc})
                elif err.code != Code.UNAVAILABLE:  # UNAVAILABLE: the state change was logged once
                    self._refusals.log(rec.transport, rec.rpc, err)
        finally:
            self.client_calls.leave(rec.client)
            self.metrics.inflight.labels(rec.transport).dec()
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()
        return err


    def _count(self, transport: str, rpc: str, code: Code) -> None:
        self.metrics.requests.labels(transport, rpc, code.name).inc()
        if code != Code.OK:
            self.metrics.errors.labels(transport, code.name).inc()

    def _on_engine_call(self, ec) -> None:  # engine thread
        self.metrics.record_engine_call(ec)
        replays = getattr(self.engine, "graph_replays", None)
        if isinstance(replays, int) and replays > self._graph_replays:
            self.metrics.graph_replays.labels(self.desc.method).inc(replays - self._graph_replays)
            self._graph_replays = replays

    def _update_gauges(self) -> None:
        self.metrics.sessions.set(len(self.sessions))
        for g, free in enumerate(self.sessions.free_blocks()):
            self.metrics.free_blocks.labels(str(g)).set(free)

    # ------------------------------------------------------------------ the four calls
    def _check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise DrafterError(Code.FAILED_PRECONDITION, "epoch",
                               f"stale epoch {epoch}: the drafter restarted (epoch {self.epoch}); attach again")

    def _limits(self) -> schema.Limits:
        d = self.desc
        return schema.Limits(max_model_len=d.max_model_len, max_num_seqs=d.max_num_seqs,
                             max_num_batched_tokens=d.max_num_batched_tokens, max_message_bytes=d.max_message_bytes,
                             vocab_size=d.vocab_size, hidden_width=d.hidden_width,
                             kv_groups=[schema.KVGroup(block_size=bs, num_blocks=n)
                                        for bs, n in zip(d.block_sizes, d.pool_blocks)])

    def _tree(self) -> list[schema.TreePath]:
        return [schema.TreePath(ranks=list(p)) for p in (self.desc.speculative_token_tree or ())]

    async def attach(self, req: schema.AttachRequest, caller: Caller | None = None) -> schema.AttachResponse:
        """caller: who attaches (its authenticated peer, if any, owns the session; its client identity
        counts against the per-client quotas).  The caller's own session of the same client_name is
        replaced: detached and its blocks freed before the new one is reserved."""
        caller = caller or Caller()
        try:
            old = self.sessions.replaceable(req, caller)
            if old is not None and old.id in self.sessions.sessions:
                self.sessions.detach(old.id, old.owner)
                await self._release(old, "replaced")
            s = self.sessions.attach(req, caller)
        except DrafterError as e:
            log.warning("attach refused", extra={"event": "attach_refused", "code": e.code.name, "field": e.field,
                                                  "client": req.client_name[:128], "reason": e.message})
            raise
        self._update_gauges()
        log.info("session attached", extra={"event": "attach", "session": session_tag(s.id), "client": s.client_name,
                                            "num_blocks": list(s.num_blocks), "bases": list(s.bases)})
        d = self.desc
        limits = self._limits()
        limits.max_num_seqs, limits.max_num_batched_tokens = s.max_num_seqs, s.max_num_batched_tokens
        limits.kv_groups = [schema.KVGroup(block_size=bs, num_blocks=n) for bs, n in zip(s.block_sizes, s.num_blocks)]
        return schema.AttachResponse(
            session_id=s.id, epoch=self.epoch, capture_sizes=list(d.capture_sizes),
            token_capture_sizes=list(d.token_capture_sizes), limits=limits, aux_layer_ids=list(d.aux_layer_ids),
            num_speculative_tokens=d.num_speculative_tokens, speculative_token_tree=self._tree(),
            protocol_version=PROTOCOL_VERSION, cuda_ipc=self.cuda_ipc if req.cuda_ipc_capable else None)

    def check(self, call: ProposeRequest) -> Session:
        """Everything that can be decided in the event loop, cheaply, before queueing."""
        self._check_epoch(call.epoch)
        s = self.sessions.owned(call.session_id, call.caller.peer if call.caller is not None else "")
        if call.hidden_ipc is not None and not self.cuda_ipc.enabled:
            raise invalid(IPC_FIELD, f"this drafter does not open CUDA IPC references: {self.cuda_ipc.reason}; "
                                     f"send target_hidden_states")
        check_call(s, call, self.desc)
        return s

    def _admit(self, call: ProposeRequest) -> Session:
        s = self.check(call)
        if call.probe is not None:
            call.probe.mark("validate")
        s.last_used = time.monotonic()
        s.calls += 1
        return s

    async def serve_propose(self, call: ProposeRequest) -> ProposeResult:
        result = await self.batcher.submit(self._admit(call), call)
        self.record_acceptance(call)
        return result

    def _work_waiting(self) -> bool:
        """Engine thread: whether a request or job waits for the engine (collected or queued)."""
        batcher, q = getattr(self, "batcher", None), getattr(self.executor, "_q", None)
        return bool(batcher is not None and batcher.fair) or (q is not None and not q.empty())

    def serve_propose_nowait(self, call: ProposeRequest, on_done, reply=None, push=None) -> None:
        """The same checks as serve_propose() (raising DrafterError here for what the event loop decides),
        then the call goes straight to the engine thread; reply(result), if given, runs there as soon
        as the drafts are on the host (successful calls only), and on_done(result or DrafterError)
        runs in this event loop after it.  Call record_acceptance(call) after answering."""
        self.batcher.submit_nowait(self._admit(call), call, on_done, reply, push)

    def record_acceptance(self, call: ProposeRequest) -> None:
        report = accepted_from_report(call.accepted_counts, call.inputs.num_rejected_tokens,
                                      call.inputs.query_start_loc, self.desc.num_speculative_tokens)
        if report is not None:
            self.metrics.record_acceptance(report, self.desc.num_speculative_tokens)

    async def detach(self, req: schema.DetachRequest, reason: str = "client",
                     caller: Caller | None = None) -> schema.DetachResponse:
        self._check_epoch(req.epoch)
        s = self.sessions.detach(req.session_id, caller.peer if caller is not None else "")
        await self._release(s, reason)
        return schema.DetachResponse(blocks_released=sum(s.num_blocks))

    async def _release(self, s: Session, reason: str) -> None:
        try:
            # Behind any batch of this session already in the engine thread (it is FIFO).
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self.executor, release_session, self.engine, self.runner, s)
        finally:
            self.sessions.release(s)
            self._update_gauges()
        log.info("session detached", extra={"event": "detach", "session": session_tag(s.id), "client": s.client_name,
                                            "reason": reason, "calls": s.calls})

    async def _expire_idle(self) -> None:
        period = max(0.05, min(30.0, self.session_idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)  # a periodic sweep, not synchronisation
            for s in self.sessions.idle(time.monotonic(), self.session_idle_timeout_s):
                if s.alive and s.id in self.sessions.sessions:
                    self.sessions.detach(s.id, s.owner)
                    await self._release(s, "idle")

    def info(self, req: schema.InfoRequest | None = None) -> schema.InfoResponse:
        d = self.desc
        asked = req is not None and req.cuda_ipc_capable
        return schema.InfoResponse(
            protocol_version=PROTOCOL_VERSION, epoch=self.epoch, state=self.state, method=d.method,
            num_speculative_tokens=d.num_speculative_tokens, speculative_token_tree=self._tree(), dtype=d.dtype,
            hidden_size=d.hidden_size, num_aux_layers=d.num_aux_layers, aux_layer_ids=list(d.aux_layer_ids),
            limits=self._limits(), capture_sizes=list(d.capture_sizes),
            token_capture_sizes=list(d.token_capture_sizes), num_sessions=len(self.sessions),
            max_sessions=self.max_sessions, free_blocks=self.sessions.free_blocks(), version=VERSION,
            cuda_ipc=self.cuda_ipc if asked else None, mtp_layer_schedule=d.mtp_layer_schedule,
            predraft_tokens=d.predraft_tokens)
