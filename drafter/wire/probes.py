"""Opt-in per-stage timing of the remote propose path (server and clients), for the transport benches.

Off by default: a transport's probe point is `if probe is not None: probe.mark(...)`, one attribute
test; a step of the engine thread is a method decorated with `@staged(...)`, which while probes are
off leaves the plain method in its class (no test at all) and on enable() swaps in one that marks.
On (`enable()`, or DRAFTER_PROBES=1 in the environment before this module is imported), each
propose call carries a Probe: a list of (stage, perf_counter_ns) marks appended as the call
passes each stage, in whichever thread it is.  A stage's duration is the time since the
previous mark.  Finished probes are kept per label ("zmq-tcp", "grpc-unary", "client-zmq", ...)
and summarised as p50/p90/mean per stage; `engine_ns` keeps each call's engine time by request
id, so a bench can subtract it from the same call's round trip.
"""

from __future__ import annotations

import functools
import os
import statistics
import threading
import time
from collections import defaultdict
from typing import Callable, Iterable

now_ns = time.perf_counter_ns
MAX_CALLS = 200_000  # per label: a long-running server with probes on must not grow without bound


class Probe:
    __slots__ = ("label", "marks", "request_id")

    def __init__(self, label: str, t0: int | None = None):
        self.label = label
        self.request_id = 0
        self.marks = [("start", now_ns() if t0 is None else t0)]

    def mark(self, stage: str) -> None:
        self.marks.append((stage, now_ns()))

    def stages(self) -> list[tuple[str, int]]:
        return [(name, t - self.marks[i][1]) for i, (name, t) in enumerate(self.marks[1:])]

    def finish(self) -> None:
        rec = RECORDER
        if rec is not None:
            rec.add(self)


class Recorder:
    def __init__(self):
        self.lock = threading.Lock()
        self.calls: dict[str, list[Probe]] = defaultdict(list)

    def add(self, probe: Probe) -> None:
        with self.lock:
            calls = self.calls[probe.label]
            if len(calls) < MAX_CALLS:
                calls.append(probe)

    def marks(self) -> dict:
        """{label: {request_id: [(stage, absolute perf_counter_ns), ...]}}: perf_counter_ns is
        CLOCK_MONOTONIC, so marks of a client and a server on one host line up."""
        with self.lock:
            return {label: {p.request_id: p.marks for p in probes} for label, probes in self.calls.items()}

    def summary(self, reset: bool = False, skip: int = 0) -> dict:
        """{label: {"calls", "stages": {stage: {p50_us, p90_us, mean_us}}, "order", "engine_ns"}}.
        skip: leave out each label's first calls (warm-up)."""
        with self.lock:
            calls = {k: v[skip:] for k, v in self.calls.items()}
            if reset:
                self.calls = defaultdict(list)
        out = {}
        for label, probes in calls.items():
            per: dict[str, list[int]] = defaultdict(list)
            order: list[str] = []
            engine = {}
            for p in probes:
                for name, ns in p.stages():
                    if name not in per:
                        order.append(name)
                    per[name].append(ns)
                    if name == "engine":
                        engine[p.request_id] = ns
                total = p.marks[-1][1] - p.marks[0][1]
                per["total"].append(total)
            out[label] = {"calls": len(probes), "order": order + ["total"],
                          "stages": {name: percentiles_us(xs) for name, xs in per.items()}, "engine_ns": engine}
        return out


def percentiles_us(xs_ns: list[int]) -> dict:
    xs = sorted(xs_ns)
    if not xs:
        return {}
    return {"p50_us": statistics.median(xs) / 1e3, "p90_us": xs[int(0.9 * (len(xs) - 1))] / 1e3,
            "mean_us": sum(xs) / len(xs) / 1e3, "n": len(xs)}


RECORDER: Recorder | None = None


def enable() -> Recorder:
    global RECORDER
    if RECORDER is None:
        RECORDER = Recorder()
        _swap(marking=True)
    return RECORDER


def disable() -> None:
    global RECORDER
    RECORDER = None
    _swap(marking=False)


# (class, method name, plain method, marking method) of every @staged method
_STAGED: list[tuple[type, str, Callable, Callable]] = []


def _swap(marking: bool) -> None:
    for owner, name, plain, marked in _STAGED:
        setattr(owner, name, marked if marking else plain)


class staged:  # noqa: N801 - used as a decorator
    """Method decorator for one step of the propose path: `stage` is marked on the probe of every
    request the step handled, before the step runs (before=True) or once it returned.
    calls(*args) names those requests (objects with a `probe`) from the method's arguments."""

    def __init__(self, stage: str, calls: Callable[..., Iterable], before: bool = False):
        self.stage, self.calls, self.before = stage, calls, before

    def __call__(self, fn: Callable) -> "staged":
        self.fn = fn
        return self

    def __set_name__(self, owner: type, name: str) -> None:
        fn, stage, calls, before = self.fn, self.stage, self.calls, self.before

        @functools.wraps(fn)
        def marked(*args, **kwargs):
            if before:
                _mark_all(calls(*args, **kwargs), stage)
            out = fn(*args, **kwargs)
            if not before:
                _mark_all(calls(*args, **kwargs), stage)
            return out

        _STAGED.append((owner, name, fn, marked))
        setattr(owner, name, marked if RECORDER is not None else fn)


def _mark_all(calls: Iterable, stage: str) -> None:
    for call in calls:
        if call.probe is not None:
            call.probe.mark(stage)


def start(label: str, t0: int | None = None) -> Probe | None:
    """A new probe when probes are on, else None (the hot path then only tests for None)."""
    return None if RECORDER is None else Probe(label, t0)


def labelled(probe: Probe | None, call) -> Probe | None:
    """A server probe relabelled "<transport>-cuda" for a call whose hidden states came by CUDA IPC
    reference, so that its stages are summarised apart from the byte-carrying calls."""
    if probe is not None and getattr(call, "hidden_ipc", None) is not None:
        probe.label += "-cuda"
    return probe


if os.environ.get("DRAFTER_PROBES", "") not in ("", "0"):
    enable()
