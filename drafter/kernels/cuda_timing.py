"""Device time of short GPU work, free of host launch cost.

Timing one launch with events around it measures the host too: the GPU reaches the start
event, then idles until Python has issued the kernel (20-30 us for a Triton launch on the
GPU hosts we use, longer than many of the kernels).  Capturing several calls into a CUDA graph
and timing its replays measures the device alone.
"""

from __future__ import annotations

import ctypes
import statistics
from typing import Callable

import torch

_capture_streams: dict[torch.device, torch.cuda.Stream] = {}


_CU_STREAM_NON_BLOCKING = 1


def private_stream(device: torch.device) -> torch.cuda.Stream:
    """A CUDA stream created for the caller alone: not one of torch's pooled streams, which
    torch.cuda.Stream() hands out round-robin to every caller in the process (torch.cuda.graph's
    default capture stream is one of them).  Never destroyed: a later stream could get its
    address, and with it the cuBLAS workspace torch keeps for that address, in this caller's
    pool (a CUDA stream is a few hundred bytes of driver state)."""
    device = torch.device(device)
    driver = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        torch.cuda.synchronize()  # the runtime makes the device's primary context current on this thread
        rc = driver.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(_CU_STREAM_NON_BLOCKING))
        if rc != 0:
            raise RuntimeError(f"cuStreamCreate failed with CUresult {rc}")
        return torch.cuda.ExternalStream(handle.value, device=device)


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream of this module's own per device for the timing graphs, so that the cuBLAS
    workspace their captures allocate (in a pool that dies with them) is never the one torch
    keeps for its shared default capture stream, which another caller's long-lived graphs would
    then borrow (drafter.engine.graphs explains the hazard)."""
    if device not in _capture_streams:
        _capture_streams[device] = private_stream(device)
    return _capture_streams[device]


def graph_time_us(fn: Callable[[int], object], calls: int = 8, reps: int = 10) -> float:
    """Median device microseconds of one fn(i) call, i = 0 .. calls-1 captured back to back
    (fn may rotate over inputs by i so that repeated calls do not hit in L2)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture: compiles, cuBLAS handles and workspaces
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=_capture_stream(torch.device("cuda", torch.cuda.current_device()))):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)
