"""When calls are sent: open loop (a rate, send times fixed up front) or closed loop (N in flight).

Open loop is what a fleet of target workers looks like to a drafter: steps arrive whether or not
the drafter kept up.  Every call's send time is decided before the run starts, and its latency is
measured from that *scheduled* time, not from when a sender got round to it: when the drafter (or
the load generator) falls behind, the wait shows up in the latency instead of silently lowering
the offered load ("coordinated omission").

Closed loop keeps N calls in flight per session and sends the next one when one returns: it
measures the most the drafter sustains at that concurrency, and its latency is service time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ARRIVALS = ("poisson", "constant")


def open_loop_times(rate: float, duration_s: float, *, arrival: str = "poisson", seed: int = 0,
                    max_calls: int = 0, start_s: float = 0.0) -> np.ndarray:
    """Send times (seconds from the run's start, sorted) of an open-loop stream at `rate` calls/s.

    poisson: exponential inter-arrival gaps with mean 1/rate (a Poisson process), drawn from a
    seeded generator; constant: exactly 1/rate apart.  Times lie in [start_s, duration_s);
    max_calls > 0 keeps only the first max_calls.
    """
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    span = duration_s - start_s
    expected = rate * span
    if max_calls > 0:
        expected = min(expected, max_calls)
    if arrival == "constant":
        n = int(np.ceil(rate * span))
        times = start_s + np.arange(n) / rate
    else:
        rng = np.random.default_rng(seed)
        # draw gaps in chunks (the mean plus a few standard deviations first) until past the horizon
        chunk = int(expected + 6 * np.sqrt(expected) + 16)
        parts, last, count = [], start_s, 0
        while last < duration_s and (max_calls <= 0 or count < max_calls):
            part = last + np.cumsum(rng.exponential(1.0 / rate, chunk))
            parts.append(part)
            last, count = float(part[-1]), count + chunk
        times = np.concatenate(parts) if parts else np.zeros(0)
    times = times[times < duration_s]
    if max_calls > 0:
        times = times[:max_calls]
    return times


@dataclass(frozen=True)
class OpenLoop:
    rate: float  # calls/s over all sessions
    arrival: str = "poisson"
    max_inflight: int = 8  # senders (connections) per session: how many calls of one session overlap at most

    def session_times(self, sessions: int, duration_s: float, seed: int, max_calls: int = 0) -> list[np.ndarray]:
        """One stream per session, each at rate / sessions (independent seeds): their union has the
        total rate.  max_calls bounds the total, shared out evenly."""
        per = self.rate / sessions
        cap = -(-max_calls // sessions) if max_calls > 0 else 0
        return [open_loop_times(per, duration_s, arrival=self.arrival, seed=seed * 1000 + s, max_calls=cap)
                for s in range(sessions)]

    def describe(self) -> dict:
        return {"mode": "open", "rate": self.rate, "arrival": self.arrival, "max_inflight": self.max_inflight}


@dataclass(frozen=True)
class ClosedLoop:
    concurrency: int = 1  # calls in flight per session

    def describe(self) -> dict:
        return {"mode": "closed", "concurrency": self.concurrency}
