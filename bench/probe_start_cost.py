"""Probe: what each way of starting an armed step costs the target's host (issue 18).

An armed cuda_ipc step is started by the target's GPU: after its inputs, the target queues on its
stream the write of a small record and a go word into memory the drafter's GPU waits on.  The
bound bench puts the target's host time for that at 25-65 us with two cuMemcpyHtoDAsync calls into
the drafter's (IPC-opened) memory, against 15-18 us for the unarmed path's one event record.  This
probe times each candidate call alone, in a loop, from a process whose current device is
--target-device, on memory a child process allocated on --drafter-device and shared over CUDA IPC:

  copy_local / copy_peer      cuMemcpyHtoDAsync of 48 bytes from pinned memory (local / IPC memory)
  copy2_peer                  the two copies an armed step makes today
  write_local / write_peer    cuStreamWriteValue32 into local / IPC memory
  write_host                  cuStreamWriteValue32 into shared host memory (cuMemHostRegister'd, mapped)
  event_record                torch.cuda.Event(interprocess=True).record()
  stream_lookup               torch.cuda.current_stream(device).cuda_stream (what a step reads first)

each with the target's stream idle and with ~2 ms of work queued ahead of it (busy).  Then a
functional check of the host-memory go word: the child's stream waits on it (cuStreamWaitValue32 on
its own mapping of the same shared memory) and records an event the parent's write releases.

    python bench/probe_start_cost.py --target-device cuda:0 --drafter-device cuda:1 --iters 2000

Prints one JSON line per call: p50 / p90 / p99 host us, or the driver error it returned.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

from drafter.wire import stream_ops

HOST_REGISTER_PORTABLE, HOST_REGISTER_DEVICEMAP = 0x01, 0x02


def _lib():
    lib = ctypes.CDLL("libcuda.so.1")
    reg = getattr(lib, "cuMemHostRegister_v2", None) or lib.cuMemHostRegister
    reg.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    reg.restype = ctypes.c_int
    dptr = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or lib.cuMemHostGetDevicePointer
    dptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    dptr.restype = ctypes.c_int
    return reg, dptr


def _host_word(path: str):
    """A page of shared host memory (a file under /dev/shm), registered and mapped for this
    process's GPUs: (the mmap, its host address, its device address)."""
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, 4096)
    os.close(fd)
    host = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    reg, dptr = _lib()
    rc = reg(host, 4096, HOST_REGISTER_PORTABLE | HOST_REGISTER_DEVICEMAP)
    if rc != 0:
        raise RuntimeError(f"cuMemHostRegister failed: {rc}")
    dev = ctypes.c_uint64()
    rc = dptr(ctypes.byref(dev), host, 0)
    if rc != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed: {rc}")
    return mm, host, dev.value


def _child(device: str, q_out, q_in, shm_path: str):
    """The "drafter": its memory shared with the parent; then a GPU wait on the shared host word."""
    torch.cuda.set_device(device)
    buf = torch.zeros(64, dtype=torch.int64, device=device)
    q_out.put(buf)
    q_in.get()  # the parent's timing is done
    mm, _, dev = _host_word(shm_path)
    stream = torch.cuda.Stream(device)
    done = torch.cuda.Event(interprocess=True)
    results = []
    for step in range(1, 51):
        stream_ops.wait_geq(stream.cuda_stream, dev, step)
        done.record(stream)
        q_out.put(("queued", step))
        q_in.get()  # the parent wrote the word
        t0 = time.perf_counter()
        done.synchronize()
        results.append((time.perf_counter() - t0) * 1e6)
    q_out.put(("done", statistics.median(results)))
    q_in.get()
    del mm


def _time(fn, iters: int, busy=None) -> dict:
    samples = []
    for i in range(iters):
        if busy is not None and i % 20 == 0:
            torch.cuda.synchronize()
            busy()
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    samples.sort()
    pick = lambda q: round(samples[int(q * (len(samples) - 1))], 2)  # noqa: E731
    return {"p50_us": pick(0.5), "p90_us": pick(0.9), "p99_us": pick(0.99)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-device", default="cuda:0")
    ap.add_argument("--drafter-device", default="cuda:1")
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    dev = torch.device(args.target_device)
    torch.cuda.set_device(dev)
    shm = tempfile.NamedTemporaryFile(dir="/dev/shm", delete=False)
    shm.write(b"\0" * 4096)
    shm.flush()
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child, args=(args.drafter_device, q_out, q_in, shm.name))
    child.start()
    peer = q_out.get()  # [64] int64 on the drafter's GPU, opened here over CUDA IPC
    local = torch.zeros(64, dtype=torch.int64, device=dev)
    src = torch.zeros(16, dtype=torch.int64, pin_memory=True)
    mm, _, host_dev = _host_word(shm.name)
    stream = torch.cuda.current_stream(dev)
    s = stream.cuda_stream
    ev = torch.cuda.Event(interprocess=True)
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    busy = lambda: [a @ a for _ in range(6)]  # noqa: E731  ~2 ms queued ahead
    calls = {
        "copy_local": lambda: stream_ops.copy_to_device(s, local.data_ptr(), src.data_ptr(), 48),
        "copy_peer": lambda: stream_ops.copy_to_device(s, peer.data_ptr(), src.data_ptr(), 48),
        "copy2_peer": lambda: (stream_ops.copy_to_device(s, peer.data_ptr() + 8, src.data_ptr() + 8, 40),
                               stream_ops.copy_to_device(s, peer.data_ptr(), src.data_ptr(), 8)),
        "write_local": lambda: stream_ops.write(s, local.data_ptr(), 1),
        "write_peer": lambda: stream_ops.write(s, peer.data_ptr(), 1),
        "write_host": lambda: stream_ops.write(s, host_dev, 1),
        "event_record": lambda: ev.record(stream),
        "stream_lookup": lambda: torch.cuda.current_stream(dev).cuda_stream,
    }
    for name, fn in calls.items():
        for load, b in (("idle", None), ("busy", busy)):
            try:
                torch.cuda.synchronize()
                row = {"call": name, "stream": load, **_time(fn, args.iters, b)}
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a probe reports what the driver said
                row = {"call": name, "stream": load, "error": str(exc)[:200]}
                torch.cuda.synchronize()
            print(json.dumps(row), flush=True)
    # the host-memory go word, end to end: the child's GPU waits on it, this GPU writes it
    q_in.put("go")
    lat = []
    for step in range(1, 51):
        assert q_out.get()[0] == "queued"
        t0 = time.perf_counter_ns()
        stream_ops.write(s, host_dev, step)
        lat.append((time.perf_counter_ns() - t0) / 1e3)
        q_in.put("written")
    kind, child_wait = q_out.get()
    print(json.dumps({"call": "host_go_end_to_end", "steps": 50, "write_p50_us": statistics.median(lat),
                      "child_wait_after_write_p50_us": round(child_wait, 1), "ok": kind == "done"}), flush=True)
    q_in.put("bye")
    child.join(30)
    os.unlink(shm.name)
    del mm


if __name__ == "__main__":
    main()
