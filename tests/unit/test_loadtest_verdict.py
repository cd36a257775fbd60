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


class _Capacity:
    """A stand-in for one run of the load test: rates up to `serves` calls/s are served, above it
    every call fails (what a drafter slower than the CPU profile assumes looks like)."""

    def __init__(self, serves: float):
        self.serves, self.rates = serves, []

    def __call__(self, session, transport, sched, name):
        self.rates.append(sched.rate)
        summ = _summ(20, 0 if sched.rate <= self.serves else 20, min(sched.rate, self.serves))
        session.open_runs.setdefault(transport, []).append((sched.rate, summ))
        session.answered[transport] = session.answered.get(transport, False) or summ["ok"] > 0
        return summ


def _sweep(serves: float, given_rates=None):
    import argparse

    from coordinator.loadtest import cli

    ns = argparse.Namespace(transport=["zmq"], mode=["open"], rate=given_rates, arrival="poisson", max_inflight=8,
                            concurrency=1)
    session = cli._Session(ns, out=None, server=None, server_desc={}, command=[])
    capacity = _Capacity(serves)
    session.one = lambda transport, sched, name: capacity(session, transport, sched, name)
    session.all(cli._plan(ns, "cpu"))
    return capacity.rates, session


def test_the_default_ladder_descends_below_its_start_until_a_rate_is_served():
    rates, session = _sweep(serves=2.5)  # the CPU ladder starts at 8 calls/s
    assert rates == [8.0, 4.0, 2.0]
    knee = session.knees()[0]
    assert (knee.served_rate, knee.failed_rate) == (2.0, 4.0) and all(session.answered.values())
    climbs, _ = _sweep(serves=20.0)  # a start that is served climbs as before, and never descends
    assert climbs == [8.0, 16.0, 32.0]
    floor, session = _sweep(serves=0.1)  # nothing is served: down to 1 call/s, no further
    assert floor == [8.0, 4.0, 2.0, 1.0] and not any(session.answered.values())
    given, _ = _sweep(serves=2.5, given_rates=[8.0, 16.0])  # rates the user named are run as named, no descent
    assert given == [8.0, 16.0]
