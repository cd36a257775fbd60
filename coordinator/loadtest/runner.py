"""Drive the simulated sessions against a drafter with threads, one connection per sender.

    RunConfig -> Runner(cfg).run() -> RunResult (samples + what the drafter said)

Sessions: `dp` sessions (DP ranks), each attached once; `tp` is recorded only: in a TP group rank 0
sends for all ranks (the hidden states are replicated), so TP multiplies who *receives* drafts,
not what the drafter serves.  Each session has several senders (threads, each with its own
connection and the session's id), so calls of one session can overlap as a pipelined target's
would; the steps of a session come from one SessionWorkload, in order.

Open loop: a dispatcher thread paces the pre-computed send times, builds each step just in time
and queues it for the session's senders; a sender takes it when free.  The per-call deadline
counts from the scheduled time (a target step waits at most that long in all), so a call that
waited in the queue past it is recorded as DEADLINE_EXCEEDED without being sent, and the drain at
the end is bounded by one deadline.  Closed loop: each sender sends its session's next step as
soon as its last call returned.

Errors never stop the run: each is recorded with its DrafterError code (an exception the client
did not map is recorded as CLIENT_<ExceptionType>).  Bounds: --duration (no call is scheduled or
started after it) and --max-requests (calls of all sessions together, warm-up included).
"""

from __future__ import annotations

import heapq
import queue
import socket
import threading
import time
from dataclasses import dataclass, field, replace

from coordinator.client_auth import ClientAuth
from coordinator.loadtest.clients import Connection
from coordinator.loadtest.schedule import ClosedLoop, OpenLoop
from coordinator.loadtest.stats import OK, Samples
from coordinator.loadtest.workload import (SessionShape, SessionWorkload, WorkloadConfig, blocks_per_slot,
                                      session_blocks)
from drafter.wire import schema
from drafter.wire.errors import DrafterError

NAN = float("nan")


@dataclass
class RunConfig:
    transport: str
    endpoint: str
    schedule: OpenLoop | ClosedLoop
    workload: WorkloadConfig
    dp: int = 1
    tp: int = 1
    duration_s: float = 10.0
    warmup_s: float = 2.0
    max_requests: int = 0  # 0: only the duration bounds the run
    timeout_s: float = 1.0  # per-call deadline
    seed: int = 0
    client_name: str = "drafter-loadtest"
    auth: ClientAuth = ClientAuth()  # --curve-* / --tls-* (coordinator.client_auth)


@dataclass
class RunResult:
    samples: Samples
    end_s: float  # end of the measured window (scheduling phase), seconds from the start
    started_at: float  # wall clock (time.time()) at t = 0
    wall_s: float  # the whole run, attach to detach
    info: schema.InfoResponse
    attach: list[schema.AttachResponse]
    layout: schema.AttachRequest
    shape: SessionShape
    notes: list[str] = field(default_factory=list)
    generator_cpu_s: float = 0.0  # CPU time of this process (all its threads) while the calls ran


def shape_from_info(info: schema.InfoResponse) -> SessionShape:
    tree = [tuple(p.ranks) for p in info.speculative_token_tree]
    lim = info.limits
    k = max(len(p) for p in tree) if tree else info.num_speculative_tokens
    return SessionShape(
        hidden_width=lim.hidden_width, hidden_dtype=info.dtype, vocab_size=lim.vocab_size,
        max_model_len=lim.max_model_len, block_sizes=tuple(g.block_size for g in lim.kv_groups),
        num_speculative_tokens=k, draft_span=len(tree) if tree else info.num_speculative_tokens - 1,
        num_drafts=len(tree) if tree else info.num_speculative_tokens)


def attach_layout(info: schema.InfoResponse, wl: WorkloadConfig, shape: SessionShape,
                  client_name: str) -> schema.AttachRequest:
    """What each simulated target worker attaches with: the drafter's own settings, our pool."""
    return schema.AttachRequest(
        protocol_version=info.protocol_version, method=info.method,
        num_speculative_tokens=info.num_speculative_tokens, speculative_token_tree=info.speculative_token_tree,
        hidden_dtype=shape.hidden_dtype, hidden_size=info.hidden_size, num_aux_layers=info.num_aux_layers,
        max_model_len=shape.max_model_len, max_num_seqs=wl.max_num_seqs,
        max_num_batched_tokens=wl.max_num_batched_tokens,
        kv_groups=[schema.KVGroup(block_size=bs, num_blocks=n)
                   for bs, n in zip(shape.block_sizes, session_blocks(shape, wl))],
        client_name=client_name)


def fit_workload(wl: WorkloadConfig, info: schema.InfoResponse) -> WorkloadConfig:
    """The session limits the drafter allows (ours when smaller)."""
    lim = info.limits
    return replace(wl, max_num_seqs=min(wl.max_num_seqs, lim.max_num_seqs),
                   max_num_batched_tokens=min(wl.max_num_batched_tokens, lim.max_num_batched_tokens))


def fit_pool(wl: WorkloadConfig, info: schema.InfoResponse, shape: SessionShape, sessions: int
             ) -> tuple[WorkloadConfig, str | None]:
    """Fewer request slots per session when `sessions` sessions of this workload would not fit the
    drafter's free KV blocks (a drafter started with `serve`'s defaults holds 4096 per group).
    Returns the workload and a note saying what was lowered (None: it fitted)."""
    free = list(info.free_blocks) or [g.num_blocks for g in info.limits.kv_groups]
    width = blocks_per_slot(shape, wl)  # blocks one request slot needs, per KV group
    slots = min(f // sessions // w for f, w in zip(free, width))
    if slots >= wl.max_num_seqs:
        return wl, None
    need = [wl.max_num_seqs * w * sessions for w in width]
    if slots < 1:
        raise RuntimeError(f"the drafter has {free} free KV blocks; {sessions} session(s) of one request slot "
                           f"need {[w * sessions for w in width]}: start it with a larger --kv-blocks (or lower "
                           "--dp, --max-request-len or --max-model-len)")
    return replace(wl, max_num_seqs=slots), (
        f"--max-num-seqs lowered {wl.max_num_seqs} -> {slots}: {sessions} session(s) of {wl.max_num_seqs} slots need "
        f"{need} KV blocks, the drafter has {free} free (its --kv-blocks)")


def check_reachable(transport: str, endpoint: str, timeout_s: float) -> None:
    """A TCP connect first, so that a drafter that is not running is one clear line, at once."""
    from coordinator.loadtest.clients import zmq_endpoint

    address = zmq_endpoint(endpoint)
    if not address.startswith("tcp://"):
        return  # ipc:// and friends: the client reports
    host, _, port = address[len("tcp://"):].rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise RuntimeError(f"no drafter at {endpoint} ({transport}): {why}; start one with `drafter serve` "
                           "(then --endpoint HOST:PORT), or add --spawn-server --tiny eagle3") from None


def _tagged(times, session: int):
    return ((float(t), session) for t in times)


class _Counter:
    """--max-requests over all closed-loop senders."""

    def __init__(self, limit: int):
        self.limit, self.n, self.lock = limit, 0, threading.Lock()

    def take(self) -> bool:
        with self.lock:
            if self.limit > 0 and self.n >= self.limit:
                return False
            self.n += 1
            return True


class Runner:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.stop = threading.Event()  # set on Ctrl-C: senders finish their call and leave
        self.done = 0  # calls finished, for the progress display only (unlocked: may miss a few)
        self.expected = 0
        self.t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    # ------------------------------------------------------------------ one call
    def _call(self, conn: Connection, session: int, step, scheduled: float, deadline_s: float,
              out: Samples) -> None:
        sent = self.now()
        left = deadline_s - (sent - scheduled)
        if left <= 0:  # waited in the queue past its deadline: the target already gave up on it
            out.add(session=session, scheduled=scheduled, sent=NAN, done=sent, batch=step.batch,
                    tokens=step.num_tokens, prefills=step.prefills, drafted=step.drafted, request_bytes=0,
                    response_bytes=0, code="DEADLINE_EXCEEDED")
            self.done += 1
            return
        try:
            conn.propose(left, step.kwargs)
            code = OK
        except DrafterError as exc:
            code = exc.code.name
        except Exception as exc:  # noqa: BLE001 - recorded, never fatal: the run goes on
            code = f"CLIENT_{type(exc).__name__}"
        done = self.now()
        req, resp = conn.last_sizes
        out.add(session=session, scheduled=scheduled, sent=sent, done=done, batch=step.batch, tokens=step.num_tokens,
                prefills=step.prefills, drafted=step.drafted, request_bytes=req, response_bytes=resp, code=code)
        self.done += 1

    # ------------------------------------------------------------------ the two loops
    def _open_sender(self, conn, session, q: queue.Queue, out: Samples) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            scheduled, step = item
            self._call(conn, session, step, scheduled, self.cfg.timeout_s, out)

    def _dispatch(self, times, workloads, queues, senders: int) -> None:
        merged = heapq.merge(*[_tagged(ts, s) for s, ts in enumerate(times)])  # (time, session), by time
        try:
            for t, s in merged:
                if self.stop.is_set():
                    break
                wait = t - self.now()
                if wait > 0:
                    time.sleep(wait)  # pacing to the schedule (not synchronisation)
                queues[s].put((t, workloads[s].step()))
        finally:
            for q in queues:
                for _ in range(senders):
                    q.put(None)

    def _closed_sender(self, conn, session, workload: SessionWorkload, lock: threading.Lock, budget: _Counter,
                       out: Samples) -> None:
        while not self.stop.is_set() and self.now() < self.cfg.duration_s and budget.take():
            with lock:  # one session's steps are one sequence, whichever sender sends them
                step = workload.step()
            t = self.now()
            if t >= self.cfg.duration_s:
                return
            self._call(conn, session, step, t, self.cfg.timeout_s, out)

    # ------------------------------------------------------------------ run
    def run(self, progress=None) -> RunResult:
        cfg = self.cfg
        sched = cfg.schedule
        senders = sched.max_inflight if isinstance(sched, OpenLoop) else sched.concurrency
        wall0 = time.monotonic()
        conns: list[list[Connection]] = []
        try:
            check_reachable(cfg.transport, cfg.endpoint, max(cfg.timeout_s, 5.0))
            first = Connection(cfg.transport, cfg.endpoint, cfg.timeout_s, cfg.auth)
            conns.append([first])
            try:
                info = first.client.info(timeout=max(cfg.timeout_s, 10.0))
            except DrafterError as exc:
                raise RuntimeError(f"the drafter at {cfg.endpoint} ({cfg.transport}) did not answer Info: {exc}; "
                                   "is it a drafter, and is --transport its protocol on that port?") from None
            if info.state != "serving":
                raise RuntimeError(f"the drafter is {info.state}, not serving")
            shape = shape_from_info(info)
            wl, fitted = fit_pool(fit_workload(cfg.workload, info), info, shape, cfg.dp)
            layout = attach_layout(info, wl, shape, cfg.client_name)
            attached = []
            for s in range(cfg.dp):
                if s > 0:
                    conns.append([Connection(cfg.transport, cfg.endpoint, cfg.timeout_s, cfg.auth)])
                layout.client_name = f"{cfg.client_name}/dp{s}"
                try:
                    resp = conns[s][0].client.attach(layout, timeout=max(cfg.timeout_s, 10.0))
                except DrafterError as exc:
                    raise RuntimeError(f"session {s} could not attach ({exc}); the drafter needs "
                                       f"{sum(session_blocks(shape, wl))} KV blocks per session for this workload "
                                       "(raise its --kv-blocks / --max-sessions, or lower --max-num-seqs / "
                                       "--max-request-len)") from None
                attached.append(resp)
                for _ in range(senders - 1):
                    c = Connection(cfg.transport, cfg.endpoint, cfg.timeout_s, cfg.auth)
                    c.share_session(resp)
                    conns[s].append(c)
            workloads = [SessionWorkload(shape, wl, seed=cfg.seed * 7919 + s) for s in range(cfg.dp)]
            outs = [[Samples() for _ in c] for c in conns]
            threads = []
            truncated = False
            if isinstance(sched, OpenLoop):
                times = sched.session_times(cfg.dp, cfg.duration_s, cfg.seed, cfg.max_requests)
                self.expected = sum(len(t) for t in times)
                if cfg.max_requests > 0:  # did --max-requests cut the schedule short of the duration?
                    full = sched.session_times(cfg.dp, cfg.duration_s, cfg.seed, 0)
                    truncated = sum(map(len, full)) > self.expected
                queues = [queue.Queue() for _ in range(cfg.dp)]
                for s in range(cfg.dp):
                    for c, out in zip(conns[s], outs[s]):
                        threads.append(threading.Thread(target=self._open_sender, args=(c, s, queues[s], out),
                                                        name=f"sender-{s}", daemon=True))
                threads.append(threading.Thread(target=self._dispatch, args=(times, workloads, queues, senders),
                                                name="dispatcher", daemon=True))
            else:
                budget = _Counter(cfg.max_requests)
                locks = [threading.Lock() for _ in range(cfg.dp)]
                self.expected = cfg.max_requests
                for s in range(cfg.dp):
                    for c, out in zip(conns[s], outs[s]):
                        threads.append(threading.Thread(
                            target=self._closed_sender, args=(c, s, workloads[s], locks[s], budget, out),
                            name=f"sender-{s}", daemon=True))
            started_at = time.time()
            cpu0 = time.process_time()
            self.t0 = time.perf_counter()
            for t in threads:
                t.start()
            try:
                for t in threads:
                    while t.is_alive():
                        t.join(0.2)  # wake up to refresh the progress display
                        if progress is not None:
                            progress(self)
            except KeyboardInterrupt:
                self.stop.set()
                for t in threads:
                    t.join(cfg.timeout_s + 5)
            cpu_s = time.process_time() - cpu0
            samples = Samples()
            for per_session in outs:
                for out in per_session:
                    samples.extend(out)
            samples = samples.sorted()
            # The measured window ends with the duration, or earlier when the calls ran out first
            # (--max-requests): then at the last completion.
            done = [sch + lat / 1e6 for sch, lat in zip(samples.scheduled_s, samples.latency_us)]
            end_s = cfg.duration_s
            if done and (truncated or isinstance(sched, ClosedLoop)):
                end_s = min(cfg.duration_s, max(done))
            notes = [fitted] if fitted else []
            if self.stop.is_set():
                notes.append("interrupted")
            for s in range(cfg.dp):
                try:
                    conns[s][0].client.detach(timeout=max(cfg.timeout_s, 10.0))
                except DrafterError as exc:
                    notes.append(f"session {s} detach: {exc}")
            return RunResult(samples, end_s, started_at, time.monotonic() - wall0, info, attached, layout, shape,
                             notes, cpu_s)
        finally:
            for cs in conns:
                for c in cs:
                    c.close()
