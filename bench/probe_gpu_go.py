"""Probe: a drafter step started by the target's GPU instead of its host (stream memory operations).

Two processes: a "target" on --target-device and a "drafter" on --drafter-device.  Each step the
target writes an input (a kernel), then either
  host: records an interprocess "inputs" event and sends a header over a pipe; the drafter's host,
        on the header, queues a wait on that event and replays its work graph, records "done" and
        replies; or
  armed: queues a copy of a small record (step, value) into the drafter's memory and a write of
        the step into the drafter's "go" word (drafter.wire.stream_ops), then sends the header; the
        drafter queued, one step AHEAD, a GPU wait on its go word, its replay and "done", so its
        host only replies (and queues the next step) when the header comes.
and waits for the reply, then for "done" on its stream, and reads the output back.  The work graph
(--work-us of matmuls) reads the input and the record from the target and writes step-dependent
output; every step's output is checked.  In-process: the same graph replayed on the target's GPU.

    python bench/probe_gpu_go.py --target-device cuda:0 --drafter-device cuda:1 --steps 300

Prints one JSON line per mode: p50 / p99 us of the target's whole step, and the ratio to in-process.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.multiprocessing as mp

from drafter.wire import stream_ops


def _work_graph(device, inp, rec, out, work_us: float):
    """A CUDA graph of ~work_us of matmuls whose result depends on inp[0] and rec[1]."""
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)

    def body(reps):
        c = a
        for _ in range(reps):
            c = (c @ b) * 0.01
        out[0] = rec[1].to(torch.int64) * 1000 + rec[2].to(torch.int64) + (c[0, 0] * 0).to(torch.int64)

    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        body(2)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    with torch.cuda.stream(side):
        body(10)
    end.record()
    torch.cuda.synchronize(device)
    reps = max(1, int(work_us / (start.elapsed_time(end) * 1000 / 10)))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body(reps)
    return g


def drafter_main(conn, q, device_name: str, work_us: float):
    device = torch.device(device_name)
    torch.cuda.set_device(device)
    inp = q.get()  # the target's input, opened through CUDA IPC
    arm = torch.zeros(16, dtype=torch.int32, device=device)  # [0]: go; [1..]: the record
    out = torch.zeros(8, dtype=torch.int64, device=device)
    dones = [torch.cuda.Event(interprocess=True) for _ in range(2)]
    stream = torch.cuda.current_stream(device)
    for e in dones:
        e.record(stream)
    inputs_ev_handle = q.get()
    inputs_ev = torch.cuda.Event.from_ipc_handle(device, inputs_ev_handle)
    q2 = conn
    graph = _work_graph(device, inp, arm, out, work_us)
    q2.send(("ready", [bytes(e.ipc_handle()) for e in dones]))
    q.put(arm)
    q.put(out)
    s = stream.cuda_stream
    go = arm.data_ptr()
    armed_next = 0
    while True:
        msg = q2.recv()
        if msg[0] == "stop" or msg is None:
            break
        mode, step = msg
        if mode == "host":
            if armed_next:  # a step queued ahead that the target will not start: release it
                side = torch.cuda.Stream(device)
                stream_ops.write(side.cuda_stream, go, armed_next)
                armed_next = 0
            stream.wait_event(inputs_ev)
            graph.replay()
            dones[step % 2].record(stream)
            q2.send(step)
        else:
            if armed_next != step:  # not pre-queued (the first step): queue it now
                stream_ops.wait_geq(s, go, step)
                graph.replay()
                dones[step % 2].record(stream)
            q2.send(step)
            stream_ops.wait_geq(s, go, step + 1)  # the next step, queued ahead
            graph.replay()
            dones[(step + 1) % 2].record(stream)
            armed_next = step + 1
    # release a queued step nobody will start
    if armed_next:
        side = torch.cuda.Stream(device)
        stream_ops.write(side.cuda_stream, go, armed_next)
    torch.cuda.synchronize(device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-device", default="cuda:0")
    ap.add_argument("--drafter-device", default="cuda:1")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--work-us", type=float, default=700.0)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    parent, child = ctx.Pipe()
    dev = torch.device(args.target_device)
    torch.cuda.set_device(dev)
    inp = torch.zeros(4, dtype=torch.int32, device=dev)
    inputs_ev = torch.cuda.Event(interprocess=True)
    stream = torch.cuda.current_stream(dev)
    inputs_ev.record(stream)
    p = ctx.Process(target=drafter_main, args=(child, q, args.drafter_device, args.work_us))
    p.start()
    q.put(inp)
    q.put(bytes(inputs_ev.ipc_handle()))
    tag, handles = parent.recv()
    dones = [torch.cuda.Event.from_ipc_handle(dev, h) for h in handles]
    arm = q.get()
    out = q.get()
    host_out = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    out_stream = torch.cuda.current_stream(out.device)
    rec_host = torch.zeros(64, dtype=torch.int32, pin_memory=True)  # a ring of 16 records of 4 words
    results = []
    # in-process baseline: the same graph on the target's GPU
    local_arm = torch.zeros(16, dtype=torch.int32, device=dev)
    local_out = torch.zeros(8, dtype=torch.int64, device=dev)
    g = _work_graph(dev, inp, local_arm, local_out, args.work_us)
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter_ns()
        inp.fill_(i)
        g.replay()
        host_out.copy_(local_out, non_blocking=True)
        stream.synchronize()
        times.append(time.perf_counter_ns() - t0)
    base = _stats("inprocess", times, None)
    results.append(base)
    step = 0
    for mode in ("host", "armed", "host", "armed"):
        times, bad = [], 0
        for i in range(args.steps):
            step += 1
            t0 = time.perf_counter_ns()
            inp.fill_(step % 1000)
            slot = rec_host[(step % 16) * 4:(step % 16) * 4 + 4]
            slot[1], slot[2] = step % 1000, (step * 7) % 1000
            with torch.cuda.device(dev):  # the driver calls need the stream's context current
                stream_ops.copy_to_device(stream.cuda_stream, arm.data_ptr() + 4, slot.data_ptr() + 4, 8)
                if mode == "armed":
                    slot[3] = step  # the go word, by a copy of its own after the record's (peer memory: no write op)
                    stream_ops.copy_to_device(stream.cuda_stream, arm.data_ptr(), slot.data_ptr() + 12, 4)
            if mode == "host":
                inputs_ev.record(stream)
            parent.send((mode, step))
            if not parent.poll(10):
                raise SystemExit(f"no reply for step {step} ({mode}): the drafter process died")
            assert parent.recv() == step
            # the drafter's output is mapped here as a tensor of its GPU: read it on that GPU's stream
            out_stream.wait_event(dones[step % 2])
            with torch.cuda.stream(out_stream):
                host_out.copy_(out, non_blocking=True)
            out_stream.synchronize()
            times.append(time.perf_counter_ns() - t0)
            got = int(host_out[0])
            if got != (step % 1000) * 1000 + (step * 7) % 1000:
                bad += 1
        results.append(_stats(mode, times, base, bad))
    parent.send(("stop",))
    p.join(30)
    for r in results:
        print(json.dumps(r))


def _stats(mode, times, base, bad=0):
    times = sorted(times[len(times) // 10:])
    p50 = times[len(times) // 2] / 1e3
    p99 = times[int(len(times) * 0.99) - 1] / 1e3
    r = {"mode": mode, "p50_us": round(p50, 1), "p99_us": round(p99, 1), "wrong_outputs": bad}
    if base is not None:
        r["ratio"] = round(p50 / base["p50_us"], 3)
    return r


if __name__ == "__main__":
    main()
