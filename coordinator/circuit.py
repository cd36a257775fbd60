"""A circuit breaker with exponential backoff and jitter, one per drafter endpoint.

    closed --(failure_threshold failures in a row)--> open --(backoff elapsed)--> half-open
    half-open --(the one trial call succeeds)--> closed
    half-open --(it fails)--> open again, with the backoff doubled (up to backoff_max_s)

While open, the client does not call the drafter at all: the step gets no drafts immediately
instead of waiting out another deadline.  The backoff is also the reconnect schedule: the trial
call is the reconnect attempt.  Jitter (a +-fraction of the backoff) keeps the DP ranks of a
large fleet from retrying a restarted drafter in lock step.
"""

from __future__ import annotations

import enum
import random
import time
from dataclasses import dataclass
from typing import Callable


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 3
    backoff_base_s: float = 0.1
    backoff_max_s: float = 2.0
    jitter: float = 0.2

    def __post_init__(self):
        if self.failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        if not 0 < self.backoff_base_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_base_s <= backoff_max_s")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must lie in [0, 1)")


class CircuitBreaker:
    def __init__(self, cfg: BreakerConfig = BreakerConfig(), *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, on_change: Callable[[State, State], None] | None = None):
        self.cfg = cfg
        self.clock = clock
        self.rng = rng or random.Random(0)
        self.on_change = on_change
        self.state = State.CLOSED
        self.failures = 0  # consecutive, while closed
        self.opens = 0  # consecutive openings without a success: the backoff exponent
        self.retry_at = 0.0
        self.last_backoff = 0.0

    def _set(self, state: State) -> None:
        old, self.state = self.state, state
        if old != state and self.on_change:
            self.on_change(old, state)

    def backoff(self, opens: int) -> float:
        base = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * 2 ** (opens - 1))
        return base * (1 + self.cfg.jitter * self.rng.uniform(-1, 1))

    def ready(self) -> bool:
        """Would allow() let a call through now (without starting a trial)?"""
        return self.state == State.CLOSED or (self.state == State.OPEN and self.clock() >= self.retry_at)

    def allow(self) -> bool:
        if self.state == State.CLOSED:
            return True
        if self.state == State.OPEN and self.clock() >= self.retry_at:
            self._set(State.HALF_OPEN)  # exactly one trial goes out
            return True
        return False

    def record_success(self) -> None:
        self.failures = 0
        self.opens = 0
        self._set(State.CLOSED)

    def record_failure(self) -> None:
        if self.state == State.CLOSED:
            self.failures += 1
            if self.failures < self.cfg.failure_threshold:
                return
        self.failures = 0
        self.opens += 1
        self.last_backoff = self.backoff(self.opens)
        self.retry_at = self.clock() + self.last_backoff
        self._set(State.OPEN)
