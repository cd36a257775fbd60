"""The per-endpoint circuit breaker: states, exponential backoff with jitter, one trial at a time."""

from __future__ import annotations

import random

import pytest

from coordinator.circuit import BreakerConfig, CircuitBreaker, State


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _breaker(**cfg):
    clock = Clock()
    changes = []
    b = CircuitBreaker(BreakerConfig(**cfg), clock=clock, rng=random.Random(1),
                       on_change=lambda old, new: changes.append((old, new)))
    return b, clock, changes


def test_opens_after_threshold_consecutive_failures_only():
    b, clock, _ = _breaker(failure_threshold=3, jitter=0.0)
    b.record_failure()
    b.record_failure()
    b.record_success()  # resets the count
    b.record_failure()
    b.record_failure()
    assert b.state == State.CLOSED and b.allow()
    b.record_failure()
    assert b.state == State.OPEN and not b.allow()


def test_half_open_lets_exactly_one_trial_through_then_closes_or_reopens():
    b, clock, changes = _breaker(failure_threshold=1, backoff_base_s=1.0, backoff_max_s=8.0, jitter=0.0)
    b.record_failure()
    assert not b.allow()
    clock.t += 0.99
    assert not b.allow() and not b.ready()
    clock.t += 0.02
    assert b.ready() and b.allow()  # the trial
    assert b.state == State.HALF_OPEN and not b.allow()  # no second trial while it is out
    b.record_failure()  # trial failed: open again, backoff doubled
    assert b.state == State.OPEN and b.last_backoff == pytest.approx(2.0)
    clock.t += 2.01
    assert b.allow()
    b.record_success()
    assert b.state == State.CLOSED and b.allow()
    assert changes == [(State.CLOSED, State.OPEN), (State.OPEN, State.HALF_OPEN), (State.HALF_OPEN, State.OPEN),
                       (State.OPEN, State.HALF_OPEN), (State.HALF_OPEN, State.CLOSED)]


def test_backoff_doubles_up_to_the_cap_and_resets_after_success():
    b, clock, _ = _breaker(failure_threshold=1, backoff_base_s=0.1, backoff_max_s=1.0, jitter=0.0)
    seen = []
    for _ in range(6):
        b.record_failure()
        seen.append(round(b.last_backoff, 6))
        clock.t += b.last_backoff
        assert b.allow()
    assert seen == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    b.record_success()
    b.record_failure()
    assert b.last_backoff == pytest.approx(0.1)


def test_jitter_stays_within_its_fraction_and_varies():
    b, _, _ = _breaker(backoff_base_s=1.0, backoff_max_s=1.0, jitter=0.25)
    values = [b.backoff(1) for _ in range(200)]
    assert all(0.75 <= v <= 1.25 for v in values)
    assert max(values) - min(values) > 0.3  # not a constant: restarted drafters are not hit in lock step


def test_config_is_validated():
    with pytest.raises(ValueError):
        BreakerConfig(failure_threshold=0)
    with pytest.raises(ValueError):
        BreakerConfig(backoff_base_s=2.0, backoff_max_s=1.0)
    with pytest.raises(ValueError):
        BreakerConfig(jitter=1.0)
