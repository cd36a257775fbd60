"""The load test's one-line verdicts: why every call of a run failed, and where the knee is."""

from __future__ import annotations

from coordinator.loadtest.verdict import find_knee, served, why_all_failed


def _report(rate, timeout, codes, service_us=None, mode="open", dp=1, inflight=8):
    n = len(codes)
    sched = ({"mode": "open", "rate": rate, "arrival": "poisson", "max_inflight": inflight} if mode == "open"
             else {"mode": "closed", "concurrency": 2})
    return {"config": {"timeout_s": timeout, "schedule": sched, "dp": dp},
            "samples": {"code": codes, "scheduled_s": [i * 0.01 for i in range(n)],
                        "sent_s": [i * 0.01 for i in range(n)], "service_us": service_us or [None] * n}}


def test_a_deadline_below_the_service_time():
    # 5 calls/s x 0.002 s cannot fill 8 senders: nothing queued, so one call alone outlasts the deadline
    why = why_all_failed(_report(5, 0.002, ["DEADLINE_EXCEEDED"] * 10))
    assert "--timeout 0.002 s" in why and "below the drafter's service time" in why
    assert "--concurrency" in why_all_failed(_report(0, 1.0, ["DEADLINE_EXCEEDED"] * 4, mode="closed"))


def test_a_rate_above_what_the_drafter_serves():
    # 300 calls/s x 1 s fills the senders; the warm-up's answers took 80 ms: the rate is what failed
    codes = ["OK"] * 3 + ["DEADLINE_EXCEEDED"] * 50
    why = why_all_failed(_report(300, 1.0, codes, service_us=[80e3] * 3 + [None] * 50))
    assert "300 calls/s is above what the drafter serves" in why and "lower --rate" in why
    assert "took ~80 ms each" in why
    # no answer at all: both causes are possible, and the line names both flags
    both = why_all_failed(_report(300, 1.0, ["DEADLINE_EXCEEDED"] * 50))
    assert "--rate" in both and "--timeout" in both


def test_other_codes_are_named():
    why = why_all_failed(_report(5, 1.0, ["UNAVAILABLE"] * 3 + ["INVALID_ARGUMENT"]))
    assert why.startswith("every call failed (UNAVAILABLE x3, INVALID_ARGUMENT x1)")


def _summ(calls, errors, rate_ok=1.0, p99_us=5e3):
    return {"calls": calls, "errors": errors, "ok": calls - errors, "latency_us": {"p99": p99_us},
            "throughput": {"calls_per_s": rate_ok}}


def test_the_knee_is_between_the_last_served_rate_and_the_next():
    runs = [(16.0, _summ(100, 40)), (4.0, _summ(100, 0, 4.0)), (8.0, _summ(100, 1, 7.9, 20e3))]
    knee = find_knee("zmq", runs)
    assert (knee.served_rate, knee.failed_rate, knee.failed_error_share) == (8.0, 16.0, 0.4)
    assert "knee between 8 and 16 calls/s" in knee.describe() and "p99 20.0 ms" in knee.describe()
    top = find_knee("grpc", [(4.0, _summ(10, 0)), (8.0, _summ(10, 0))])
    assert top.failed_rate is None and "no knee up to this rate" in top.describe()
    low = find_knee("zmq", [(100.0, _summ(50, 50)), (200.0, _summ(50, 0))])  # the lowest rate already failed
    assert low.served_rate is None and "knee below 100 calls/s" in low.describe()
    assert find_knee("zmq", []) is None
    assert served(_summ(100, 1)) and not served(_summ(100, 2)) and not served(_summ(0, 0))
