"""What a set of runs says in one line each: why every call of a run failed, and where the knee is.

why_all_failed(report)   a run with no successful call: the deadline is below the drafter's service
                         time (calls sent at once still timed out), or the offered rate is above
                         what it serves (calls waited past the deadline), or the codes it got
find_knee(runs)          open-loop runs of one transport, by rate: the highest rate served without
                         errors (every lower rate too) and the first rate above it that was not
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.loadtest.stats import OK

GOOD_ERROR_SHARE = 0.01  # a rate is "served" when at most 1% of its measured calls failed


def served(summary: dict) -> bool:
    return summary["calls"] > 0 and summary["errors"] <= GOOD_ERROR_SHARE * summary["calls"]


def why_all_failed(report: dict) -> str:
    """One sentence: why no measured call of this run succeeded, and which flag to change.

    DEADLINE_EXCEEDED only: when the offered load cannot fill the senders within one deadline
    (rate x timeout < senders) nothing queued in the generator, so one call takes longer than the
    deadline.  Otherwise, answers that did come (in the warm-up) tell the service time: below the
    deadline, the rate is what failed; without any, both are possible and the line says so.
    """
    cfg, s = report["config"], report["samples"]
    timeout, sched = cfg["timeout_s"], cfg["schedule"]
    codes: dict[str, int] = {}
    for c in s["code"]:
        if c != OK:
            codes[c] = codes.get(c, 0) + 1
    if set(codes) != {"DEADLINE_EXCEEDED"}:
        got = ", ".join(f"{c} x{n}" for c, n in sorted(codes.items(), key=lambda kv: -kv[1]))
        return f"every call failed ({got}); the drafter's log says why"
    too_short = (f"the per-call deadline (--timeout {timeout:g} s) is below the drafter's service time: a call "
                 "gets no answer within it even when nothing queues; raise --timeout")
    if sched["mode"] == "closed":
        return too_short + " (or lower --concurrency)"
    senders = cfg["dp"] * sched["max_inflight"]
    if sched["rate"] * timeout < senders:
        return too_short
    answered = sorted(v for v, c in zip(s["service_us"], s["code"]) if c == OK and v is not None)
    too_fast = (f"the offered {sched['rate']:g} calls/s is above what the drafter serves: calls queue behind "
                f"each other past the {timeout:g} s deadline; lower --rate")
    if answered:
        median_s = answered[len(answered) // 2] / 1e6
        if median_s < timeout:
            return too_fast + f" (the calls answered took ~{median_s * 1e3:.0f} ms each)"
        return too_short
    return (f"no call was answered within --timeout {timeout:g} s at {sched['rate']:g} calls/s: lower --rate "
            "(calls queue), or raise --timeout if one call alone takes longer")


@dataclass(frozen=True)
class Knee:
    transport: str
    served_rate: float | None  # highest rate served (every lower rate too); None: not even the lowest
    failed_rate: float | None  # the first rate above it that was not served; None: every rate was
    served_p99_ms: float | None
    served_calls_per_s: float | None
    failed_error_share: float | None

    def describe(self) -> str:
        if self.served_rate is None:
            return (f"{self.transport}: knee below {self.failed_rate:g} calls/s (the lowest rate tried already "
                    f"lost {self.failed_error_share:.0%} of its calls)")
        head = (f"{self.transport}: served {self.served_rate:g} calls/s (achieved {self.served_calls_per_s:.1f}/s, "
                f"p99 {self.served_p99_ms:.1f} ms)")
        if self.failed_rate is None:
            return head + "; no knee up to this rate: try higher --rate values"
        return (head + f"; knee between {self.served_rate:g} and {self.failed_rate:g} calls/s "
                f"({self.failed_error_share:.0%} of calls failed at {self.failed_rate:g})")

    def to_json(self) -> dict:
        return {**vars(self), "text": self.describe()}


def find_knee(transport: str, runs: list[tuple[float, dict]]) -> Knee | None:
    """runs: (rate, summary) of one transport's open-loop runs; None when there are none."""
    if not runs:
        return None
    best = None
    for rate, summ in sorted(runs, key=lambda r: r[0]):
        if not served(summ):
            share = summ["errors"] / summ["calls"] if summ["calls"] else 1.0
            if best is None:
                return Knee(transport, None, rate, None, None, share)
            return Knee(transport, best[0], rate, _p99_ms(best[1]), best[1]["throughput"]["calls_per_s"], share)
        best = (rate, summ)
    return Knee(transport, best[0], None, _p99_ms(best[1]), best[1]["throughput"]["calls_per_s"], None)


def _p99_ms(summ: dict) -> float | None:
    p99 = summ["latency_us"]["p99"]
    return None if p99 is None else p99 / 1e3


def answered(summary: dict) -> bool:
    """Did a measured call of the run succeed (or none fail)?  Answers in the warm-up alone measure nothing."""
    return summary["ok"] > 0 or summary["errors"] == 0
