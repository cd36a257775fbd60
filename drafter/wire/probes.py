"""Opt-in per-stage timing of the remote propose path (server and clients), for the transport benches.

Off by default: every probe point is `if probe is not None: probe.mark(...)`, one attribute test.
On (`enable()`, or DRAFTER_PROBES=1 in the environment before this module is imported), each
propose call carries a Probe: a list of (stage, perf_counter_ns) marks appended as the call
passes each stage, in whichever thread it is.  A stage's duration is the time since the
previous mark.  Finished probes are kept per label ("zmq-tcp", "grpc-unary", "client-zmq", ...)
and summarised as p50/p90/mean per stage; `engine_ns` keeps each call's engine time by request
id, so a bench can subtract it from the same call's round trip.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections import defaultdict

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
    return RECORDER


def disable() -> None:
    global RECORDER
    RECORDER = None


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
