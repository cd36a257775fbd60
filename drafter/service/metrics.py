"""Prometheus metrics (DESIGN section 8): base units, `_total` counters, one registry per server.

Acceptance per draft position: each step the target reports, per request, how many of the
previous step's drafts it accepted; draft position i (1-based) counts as verified for every
report and as accepted when at least i drafts were accepted.  The acceptance gauge is
accepted / verified since start.

A scrape shows every call whose reply left before the scrape began.  The ZMQ transport sends a
Propose reply from the engine thread and records the call's metrics afterwards, in the event
loop (off the reply's path); it takes a ticket from the ReplyLedger before the send and returns
it once the metrics are recorded, and /metrics waits (bounded) for the tickets taken before it.
"""

from __future__ import annotations

import threading

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ReplyLedger:
    """Replies already sent whose metrics are not recorded yet, so that a scrape can wait for them.

    sent() (any thread, just before a reply leaves) returns a ticket; recorded(ticket) (after the
    call's metrics are in) returns it.  settle() waits until every ticket taken before it was
    returned, at most wait_s (a wedged event loop must not wedge the scrapes too).
    """

    def __init__(self, wait_s: float = 5.0):
        self.wait_s = wait_s
        self.on_wait = None  # test hook: called in the scraping thread when a scrape has to wait
        self._cond = threading.Condition()
        self._next = 0
        self._open: set[int] = set()

    def sent(self) -> int:
        with self._cond:
            ticket = self._next
            self._next += 1
            self._open.add(ticket)
            return ticket

    def recorded(self, ticket: int) -> None:
        with self._cond:
            self._open.discard(ticket)
            self._cond.notify_all()

    def settle(self) -> bool:
        """Wait until the replies sent before now are accounted; False when wait_s ran out first."""
        with self._cond:
            limit = self._next
            pending = lambda: bool(self._open) and min(self._open) < limit  # noqa: E731
            if not pending():
                return True
            hook = self.on_wait
        if hook is not None:
            hook()
        with self._cond:
            return self._cond.wait_for(lambda: not pending(), self.wait_s)


class _Settle:
    """Registered first: the registry collects it before any metric, so a scrape settles first."""

    def __init__(self, ledger: ReplyLedger):
        self.ledger = ledger

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        self.ledger.settle()
        return []


class Metrics:
    def __init__(self, method: str = "", registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.method = method
        self.replies = ReplyLedger()
        self.registry.register(_Settle(self.replies))
        r = self.registry
        self.latency = Histogram(
            "drafter_propose_latency_seconds", "Propose latency inside the server, from decode to reply",
            ["transport", "method"], buckets=LATENCY_BUCKETS, registry=r)
        self.engine_latency = Histogram(
            "drafter_engine_step_seconds", "One fused engine call (all draft steps)", ["method"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram(
            "drafter_queue_wait_seconds", "Time a request waited for the batcher and the engine", ["method"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("drafter_batch_size", "Requests (rows) per engine call", ["method"],
                                    buckets=SIZE_BUCKETS, registry=r)
        self.padded_batch_size = Histogram("drafter_padded_batch_size", "Rows the draft loop ran per engine call",
                                           ["method"], buckets=SIZE_BUCKETS, registry=r)
        self.tokens = Histogram("drafter_batch_tokens", "Tokens per engine call (first pass)", ["method"],
                                buckets=SIZE_BUCKETS, registry=r)
        self.padded_tokens = Histogram("drafter_padded_batch_tokens", "Tokens the first pass ran per engine call",
                                       ["method"], buckets=SIZE_BUCKETS, registry=r)
        self.fused_sessions = Histogram("drafter_fused_sessions", "Sessions fused into one engine call", ["method"],
                                        buckets=SIZE_BUCKETS, registry=r)
        self.sessions = Gauge("drafter_sessions", "Attached sessions", registry=r)
        self.inflight = Gauge("drafter_inflight_requests", "Calls being served", ["transport"], registry=r)
        self.requests = Counter("drafter_requests_total", "Calls answered, by outcome", ["transport", "rpc", "code"],
                                registry=r)
        self.errors = Counter("drafter_errors_total", "Refused calls by code", ["transport", "code"], registry=r)
        self.graph_replays = Counter("drafter_graph_replays_total", "CUDA graph replays", ["method"], registry=r)
        self.verified = Counter("drafter_draft_tokens_verified_total",
                                "Drafts the target verified, by draft position (1-based)", ["method", "position"],
                                registry=r)
        self.accepted = Counter("drafter_accepted_tokens_total", "Drafts the target accepted, by draft position",
                                ["method", "position"], registry=r)
        self.acceptance = Gauge("drafter_draft_position_acceptance",
                                "Accepted / verified drafts per draft position since start", ["method", "position"],
                                registry=r)
        self.free_blocks = Gauge("drafter_kv_free_blocks", "Free blocks in the KV pool", ["group"], registry=r)
        self.state = Gauge("drafter_serving", "1 while serving, 0 while loading or draining", registry=r)
        self.info = Info("drafter", "What this drafter serves", registry=r)
        # pre-drafting (--predraft-outcomes): per accepted length a of the verified step, the rows
        # whose outcome the pushed pre-drafts had covered (the target's hits, as this side computes them)
        self.predraft_rows = Counter("drafter_predraft_rows_total", "Rows of calls after pushed pre-drafts, by a",
                                     ["a"], registry=r)
        self.predraft_hits = Counter("drafter_predraft_hits_total", "Of those, rows a pre-draft covered, by a",
                                     ["a"], registry=r)
        self.predrafts = Counter("drafter_predrafts_total", "Pre-drafts pushed (outcomes over all rows)", registry=r)
        self.predraft_calls = Counter("drafter_predraft_pushes_total", "Pre-draft sets pushed (one per call)",
                                      registry=r)
        self.predraft_skipped = Counter("drafter_predraft_skipped_total",
                                        "Calls that asked for pre-drafts and got none: requests were waiting",
                                        registry=r)
        # after pushed pre-drafts: drafts verified / accepted by position, pre-drafted or exact
        self.predraft_verified = Counter("drafter_predraft_verified_tokens_total",
                                         "Drafts verified after pre-drafting, by source and position",
                                         ["source", "position"], registry=r)
        self.predraft_accepted = Counter("drafter_predraft_accepted_tokens_total",
                                         "Drafts accepted after pre-drafting, by source and position",
                                         ["source", "position"], registry=r)
        # the adaptive budget (drafter.service.predraft.Budget): outcomes per request of the last call
        # that asked (0 = none made), and sets the target got after it had picked, as the next calls show
        self.predraft_budget = Gauge("drafter_predraft_budget", "Outcomes pre-drafted per request for the last "
                                     "call that asked (the adaptive budget; 0 = none)", registry=r)
        self.predraft_late = Counter("drafter_predraft_late_total", "Calls showing a pushed set reached the target "
                                     "after it had picked (the budget then halves)", registry=r)
        # armed cuda_ipc steps (drafter.wire.bound.ARM_WORDS): found queued ahead at their header, or queued then
        self.armed_steps = Counter("drafter_bound_armed_steps_total", "Armed bound steps, by whether the step was "
                                   "found queued ahead at its header", ["queued_ahead"], registry=r)
        # several bindings' bound steps served by one engine call (drafter.service.batching.bound_steps)
        self.bound_fused_calls = Counter("drafter_bound_fused_calls_total", "Engine calls that served several "
                                         "bindings' bound steps at once", registry=r)
        self.bound_fused_steps = Counter("drafter_bound_fused_steps_total", "Bound steps served inside an engine "
                                         "call fused with other bindings' steps", registry=r)
        self._lock = threading.Lock()
        self._verified: dict[int, int] = {}
        self._accepted: dict[int, int] = {}

    def record_engine_call(self, ec) -> None:
        m = self.method
        self.engine_latency.labels(m).observe(ec.seconds)
        self.batch_size.labels(m).observe(ec.batch)
        self.padded_batch_size.labels(m).observe(ec.batch_padded)
        self.tokens.labels(m).observe(ec.tokens)
        self.padded_tokens.labels(m).observe(ec.tokens_padded)
        self.fused_sessions.labels(m).observe(ec.sessions)

    def record_predraft(self, rows: dict[int, int], hits: dict[int, int], outcomes: int) -> None:
        """One pushed set: rows / hits by accepted length a of the call it followed, outcomes pushed."""
        for a, n in rows.items():
            self.predraft_rows.labels(str(a)).inc(n)
            self.predraft_hits.labels(str(a)).inc(hits.get(a, 0))
        self.predrafts.inc(outcomes)
        self.predraft_calls.inc()

    def record_predraft_budget(self, outcomes: int, late: bool) -> None:
        self.predraft_budget.set(outcomes)
        if late:
            self.predraft_late.inc()

    def record_predraft_acceptance(self, source: str, verified: dict[int, int], accepted: dict[int, int]) -> None:
        """source: "predraft" | "exact"; per draft position, drafts the target verified and accepted."""
        for pos, n in verified.items():
            self.predraft_verified.labels(source, str(pos)).inc(n)
            self.predraft_accepted.labels(source, str(pos)).inc(accepted.get(pos, 0))

    def record_acceptance(self, accepted: torch.Tensor, num_drafts: int) -> None:
        """accepted: [rows] int, drafts accepted per reported request (-1 = no report)."""
        counts = [min(int(a), num_drafts) for a in accepted.tolist() if a >= 0]
        if not counts:
            return
        with self._lock:
            for pos in range(1, num_drafts + 1):
                ok = sum(1 for a in counts if a >= pos)
                self._verified[pos] = self._verified.get(pos, 0) + len(counts)
                self._accepted[pos] = self._accepted.get(pos, 0) + ok
                label = (self.method, str(pos))
                self.verified.labels(*label).inc(len(counts))
                self.accepted.labels(*label).inc(ok)
                self.acceptance.labels(*label).set(self._accepted[pos] / self._verified[pos])

    def serve_http(self, host: str, port: int) -> int:
        """Start /metrics in a thread; return the port (0 = a free one)."""
        httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        self._httpd = httpd
        return httpd.server_address[1]

    def shutdown_http(self) -> None:
        httpd = getattr(self, "_httpd", None)
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()


def accepted_from_report(accepted_counts, num_rejected, query_start_loc, k: int):
    """Per-request accepted counts for the previous step, or None if the call carries no report.

    Explicit accepted_counts win; otherwise num_rejected_tokens of rows whose query is a decode
    step (the bonus token plus k drafts) says k - rejected drafts were accepted.
    """
    if accepted_counts is not None:
        return accepted_counts
    if num_rejected is None:
        return None
    qlen = query_start_loc[1:].long() - query_start_loc[:-1].long()
    acc = torch.where(qlen == k + 1, k - num_rejected.long(), torch.full_like(qlen, -1))
    return acc
