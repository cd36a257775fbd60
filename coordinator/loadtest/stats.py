"""Recorded samples -> the numbers a load test reports.

Every call is one sample.  Times are seconds from the run's start; latencies are stored in
microseconds rounded to 0.1 us, and every statistic is computed from exactly the stored values, so
anyone holding the report can recompute it (the tests do).

Percentiles: numpy.percentile(values, q, method="linear") (Hyndman & Fan type 7, numpy's default:
linear interpolation between the closest ranks).  p99.9 needs >= 1000 samples to say more than
"the maximum"; `count` is reported beside every percentile set so a reader can judge.

Warm-up: a sample belongs to the measurement when its *scheduled* time (open loop) or send time
(closed loop) is >= warmup_s.  Samples before that are kept in the report (flagged) but excluded
from every statistic: connection set-up, CUDA graph first replays and allocator growth are not
the steady state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0, 99.9)
PERCENTILE_METHOD = "linear"
OK = "OK"


def percentile_key(q: float) -> str:
    return "p" + (f"{q:g}".replace(".", "_") if q != int(q) else str(int(q)))  # p50, p99, p99_9


@dataclass
class Samples:
    """Column arrays, one entry per call (sent or given up on), in scheduled order."""

    session: list = field(default_factory=list)  # index of the session (DP rank)
    scheduled_s: list = field(default_factory=list)  # when the call was due (closed loop: when sent)
    sent_s: list = field(default_factory=list)  # when the sender started it (NaN: never sent)
    latency_us: list = field(default_factory=list)  # done - scheduled: what the target step waited
    service_us: list = field(default_factory=list)  # done - sent: the RPC alone
    batch: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    prefills: list = field(default_factory=list)
    drafted: list = field(default_factory=list)  # draft tokens asked for (batch x drafts per request)
    request_bytes: list = field(default_factory=list)
    response_bytes: list = field(default_factory=list)
    code: list = field(default_factory=list)  # "OK" or a DrafterError code name

    COLUMNS = ("session", "scheduled_s", "sent_s", "latency_us", "service_us", "batch", "tokens", "prefills",
               "drafted", "request_bytes", "response_bytes", "code")

    def add(self, *, session: int, scheduled: float, sent: float, done: float, batch: int, tokens: int,
            prefills: int, drafted: int, request_bytes: int, response_bytes: int, code: str) -> None:
        self.session.append(session)
        self.scheduled_s.append(round(scheduled, 7))
        self.sent_s.append(round(sent, 7) if sent == sent else float("nan"))
        self.latency_us.append(round((done - scheduled) * 1e6, 1))
        self.service_us.append(round((done - sent) * 1e6, 1) if sent == sent else float("nan"))
        self.batch.append(batch)
        self.tokens.append(tokens)
        self.prefills.append(prefills)
        self.drafted.append(drafted)
        self.request_bytes.append(request_bytes)
        self.response_bytes.append(response_bytes)
        self.code.append(code)

    def extend(self, other: "Samples") -> None:
        for c in self.COLUMNS:
            getattr(self, c).extend(getattr(other, c))

    def __len__(self) -> int:
        return len(self.code)

    def sorted(self) -> "Samples":
        order = sorted(range(len(self)), key=lambda i: (self.scheduled_s[i], self.session[i]))
        out = Samples()
        for c in self.COLUMNS:
            col = getattr(self, c)
            setattr(out, c, [col[i] for i in order])
        return out

    def to_columns(self) -> dict:
        """JSON-ready: NaN (a call never sent has no send time) becomes null."""
        return {c: [None if isinstance(v, float) and v != v else v for v in getattr(self, c)] for c in self.COLUMNS}

    @classmethod
    def from_columns(cls, cols: dict) -> "Samples":
        out = cls()
        for c in cls.COLUMNS:
            setattr(out, c, [float("nan") if v is None else v for v in cols[c]])
        return out


def percentiles(values, qs=PERCENTILES) -> dict:
    """{count, mean, min, max, p50, p90, p99, p99_9} of values (empty: count 0 and nulls)."""
    arr = np.asarray(values, dtype=np.float64)
    out = {"count": int(arr.size)}
    if arr.size == 0:
        out.update({"mean": None, "min": None, "max": None}, **{percentile_key(q): None for q in qs})
        return out
    ps = np.percentile(arr, qs, method=PERCENTILE_METHOD)
    out.update(mean=float(arr.mean()), min=float(arr.min()), max=float(arr.max()))
    out.update({percentile_key(q): float(p) for q, p in zip(qs, ps)})
    return out


def measured_mask(s: Samples, warmup_s: float) -> np.ndarray:
    return np.asarray(s.scheduled_s, dtype=np.float64) >= warmup_s


def summarize(s: Samples, *, warmup_s: float, end_s: float) -> dict:
    """The report's summary over the samples scheduled in [warmup_s, end_s).

    Throughput is over that window (end_s: the end of the scheduling phase, not of the drain), so
    an overloaded run shows fewer completed calls per second than offered.
    """
    m = measured_mask(s, warmup_s)
    code = np.asarray(s.code, dtype=object)
    ok = m & (code == OK)
    window = max(end_s - warmup_s, 1e-9)
    col = lambda name, mask: np.asarray(getattr(s, name), dtype=np.float64)[mask]  # noqa: E731
    errors: dict[str, int] = {}
    for c in code[m]:
        if c != OK:
            errors[c] = errors.get(c, 0) + 1
    warm_errors: dict[str, int] = {}
    for c in code[~m]:
        if c != OK:
            warm_errors[c] = warm_errors.get(c, 0) + 1
    sent = col("sent_s", m)
    return {
        "window_s": window,
        "warmup_s": warmup_s,
        "calls": int(m.sum()),
        "ok": int(ok.sum()),
        "errors": int(m.sum() - ok.sum()),
        "errors_by_code": dict(sorted(errors.items())),
        "warmup_calls": int((~m).sum()),
        "warmup_errors_by_code": dict(sorted(warm_errors.items())),
        "never_sent": int(np.isnan(sent).sum()),  # given up on before a sender was free (deadline passed)
        "latency_us": percentiles(col("latency_us", ok)),
        "service_us": percentiles(col("service_us", ok)),
        "send_lag_us": percentiles((sent[~np.isnan(sent)] - col("scheduled_s", m)[~np.isnan(sent)]) * 1e6),
        "throughput": {
            "calls_per_s": float(ok.sum() / window),
            "drafted_tokens_per_s": float(col("drafted", ok).sum() / window),
            "target_tokens_per_s": float(col("tokens", ok).sum() / window),
            "request_mb_per_s": float(col("request_bytes", ok).sum() / window / 1e6),
        },
        "request_bytes": percentiles(col("request_bytes", ok)),
        "response_bytes": percentiles(col("response_bytes", ok)),
        "batch": percentiles(col("batch", m)),
        "tokens": percentiles(col("tokens", m)),
        "prefill_share": float(col("prefills", m).sum() / max(col("batch", m).sum(), 1)),
    }
