"""Bound remote drafting vs in-process: the nccl_channel, cuda_ipc and host-ring planes, unbound.

    python -m coordinator.bench.bound --out DIR [--batches 1,16,64 --k 3 --ctx 1024 --iters 300
        --device cuda:0 --drafter-device cuda:1 --clients nccl_channel,cuda_ipc,host_ring --targets 2]

The target's side (this process, on --device) of drafter.tools.bench.bound, which times the
in-process calls on the target's GPU and serves one `drafter serve` on --drafter-device (EAGLE-3 /
Llama-3.1-8B shapes, random weights).  Per batch these clients attach a session and time the same
decode step, drafts on the host:

  * nccl_channel: coordinator.transport.bound_channel (the slab's prefix by one NCCL send into
    the drafter's GPU, the output back by one NCCL send; the drafter on another GPU than --device;
    the header on the binding's same-host doorbell, drafter.wire.doorbell, its tcp data socket
    open beside it); nccl_channel_ipc: the same, the data socket on ipc; nccl_channel_zmq: the
    header on the tcp data socket (no doorbell);
  * cuda_ipc: coordinator.transport.bound_ipc over CUDA IPC (header-only steps, on the doorbell;
    with the drafter on another GPU it reads the target's slab over the peer link); cuda_ipc_zmq:
    the same with the header on the ZMQ data socket (every cuda_ipc client but the armed ones binds
    unarmed: armed=False); cuda_ipc_armed, cuda_ipc_armed_spin: cuda_ipc, cuda_ipc_spin armed, each
    step started from the target's stream and queued ahead on the drafter's (drafter.wire.bound.
    ARM_WORDS, the client's default); cuda_ipc_spin: the doorbell, the drafter
    polling it SPIN_US after each reply before it sleeps (BindRequest.spin_us: it catches the next
    header hot when steps come back to back, as here; a target step of milliseconds between them
    would find it asleep as cuda_ipc does); cuda_ipc_fill: each step first copies the call's
    tensors (on the GPU) into the target's buffers, as the RemoteProposer does;
  * cuda_ipc waits for the drafts as the client decides by itself (bound_ipc.same_gpu: the host
    waits on the drafter's event where both run on one GPU, else the stream);
    cuda_ipc_host_wait: the host always; cuda_ipc_stream_wait: the stream always;
  * host_ring: the same client forced onto the host ring over tcp, its steps on the binding's
    ring stream (drafter.wire.ring_stream: the GPU slab's prefix copied to the pinned ring in
    chunks, each sent as it lands; the drafter's copy of each chunk to its GPU queued as it
    lands; 4 lanes, a step on as many as get ring_stream.LANE_BYTES each); host_ring_spread: 4
    lanes, a step on every lane that gets ring_stream.CHUNK (lane_bytes 0, the striping before
    LANE_BYTES); host_ring_spin: host_ring polling for its reply without sleeping (SPIN_US,
    reply_spin_us); host_ring_ipc: the stream on a same-host UNIX name; host_ring_1lane,
    host_ring_8lane: the stream on one connection, on eight; host_ring_bulk: four lanes, the
    target's prefix copied to the host in one piece before the body goes, the drafter's in one copy
    at the step (BindRequest.stream_staging "step"); host_ring_zmq: no stream, the prefix as the ZMQ data socket's
    second frame after one device-to-host copy (the plane before the stream);
  * unbound, unbound_cuda_ipc: the ZmqDrafterClient encoding tensors per call (the hidden states
    as a per-step CUDA IPC reference for the second).

nccl_channel and cuda_ipc report the target's host time per step (step_async, the wait for the
reply excluded) and the stages of the step from both sides' perf_counter_ns stamps; the host
ring clients their stages (RING_STAGES).

--targets N (N >= 2) adds the several-targets run: N target processes (this script's `target`
mode, each on --device, each one bound session over --targets-plane at batch --targets-batch)
against the one drafter, started together; each one's step time p50 / p99 beside one target
alone.  With two GPUs every target is on GPU 0 and the drafter on GPU 1.  Order: the clients in
--clients order (every batch of one, then the next), then the several-targets run, then cuda_ipc
where the drafter is on another GPU (last: a failure there must not spoil what came before).
Every client gives its session back even when it fails (one failing plane must not leave the
drafter's KV blocks taken for the next).

Reported: p50 / p99 of each, remote p50 / in-process p50 (against the trusted propose and against
the in-process bound call); bound.json and bound.md in --out, rewritten after every batch (a run
cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from coordinator.child_process import stop_child
from drafter.tools.bench.bound import (HEAD_CONFIG, TINY, WARMUP, _call, _stats, _time, buffers, fill, in_process,
                                       start_server)

CLIENTS = ("nccl_channel", "nccl_channel_ipc", "nccl_channel_zmq", "cuda_ipc", "cuda_ipc_zmq", "cuda_ipc_spin",
           "cuda_ipc_armed", "cuda_ipc_armed_spin",
           "cuda_ipc_fill", "cuda_ipc_host_wait", "cuda_ipc_stream_wait", "host_ring",
           "host_ring_ipc", "host_ring_zmq", "host_ring_1lane", "host_ring_8lane", "host_ring_bulk", "host_ring_spread",
           "host_ring_spin", "unbound", "unbound_cuda_ipc")
BOUND = ("nccl_channel", "nccl_channel_ipc", "nccl_channel_zmq", "cuda_ipc", "cuda_ipc_zmq", "cuda_ipc_spin",
         "cuda_ipc_armed", "cuda_ipc_armed_spin",
         "cuda_ipc_fill", "cuda_ipc_host_wait", "cuda_ipc_stream_wait", "host_ring",
         "host_ring_ipc", "host_ring_zmq", "host_ring_1lane", "host_ring_8lane", "host_ring_bulk", "host_ring_spread",
         "host_ring_spin")
RINGS = ("host_ring", "host_ring_ipc", "host_ring_zmq", "host_ring_1lane", "host_ring_8lane", "host_ring_bulk",
         "host_ring_spread", "host_ring_spin")  # the ring stream on tcp (4 lanes), on a same-host UNIX name; the
# ZMQ data socket on tcp (no stream: the plane as before the stream); the stream on one lane, on eight; the stream
# with one D2H copy and one H2D copy a step; 4 lanes, every one that gets a CHUNK; host_ring polling for its reply
STAMPED = ("nccl_channel", "nccl_channel_ipc", "nccl_channel_zmq", "cuda_ipc", "cuda_ipc_zmq", "cuda_ipc_spin",
           "cuda_ipc_armed", "cuda_ipc_armed_spin",
           "cuda_ipc_fill", "cuda_ipc_host_wait", "cuda_ipc_stream_wait", *RINGS)
SPIN_US = 3000  # cuda_ipc_spin's BindRequest.spin_us: covers the bench's back-to-back steps up to batch 64
NO_DOORBELL = ("cuda_ipc_zmq", "nccl_channel_zmq")  # the header on the ZMQ data socket, to compare


def layout(endpoint: str, args):
    from coordinator.transport import ZmqDrafterClient
    from drafter.wire import schema

    probe = ZmqDrafterClient(endpoint, timeout_s=30)
    info = probe.info()
    probe.close()
    return schema.AttachRequest(
        protocol_version=info.protocol_version, method=info.method, num_speculative_tokens=info.num_speculative_tokens,
        speculative_token_tree=info.speculative_token_tree, hidden_dtype="bfloat16", hidden_size=info.hidden_size,
        num_aux_layers=info.num_aux_layers, max_model_len=info.limits.max_model_len,
        max_num_seqs=info.limits.max_num_seqs, max_num_batched_tokens=info.limits.max_num_batched_tokens,
        kv_groups=[schema.KVGroup(block_size=g.block_size, num_blocks=args.session_blocks)
                   for g in info.limits.kv_groups], client_name="bench-bound")


def open_client(endpoint: str, args, batch: int, columns: int, name: str):
    """A bound client of plane `name` (nccl_channel, cuda_ipc, cuda_ipc_host_wait, host_ring),
    bound; RuntimeError where the drafter bound another plane."""
    from coordinator.transport.bound_client import STREAM_LANES, HostRingClient
    from coordinator.transport.bound_ipc import CudaIpcBoundClient
    from drafter.wire import ring_stream as rs

    plane = {"nccl_channel": "nccl_channel", "nccl_channel_ipc": "nccl_channel",
             "nccl_channel_zmq": "nccl_channel", **{r: "host_ring" for r in RINGS}}.get(name, "cuda_ipc")
    transport = "ipc" if name in ("nccl_channel_ipc", "host_ring_ipc") else "tcp"
    shape = layout(endpoint, args)
    client = CudaIpcBoundClient(endpoint, shape, buffers(args, batch, columns), max_batch=batch,
                                device=args.device, timeout_s=args.timeout_s, allow_fallback=False,
                                transport=transport, force_ring=plane == "host_ring",
                                host_wait={"cuda_ipc_host_wait": True, "cuda_ipc_stream_wait": False}.get(name),
                                channel=plane == "nccl_channel", doorbell=name not in NO_DOORBELL,
                                spin_us=SPIN_US if name in ("cuda_ipc_spin", "cuda_ipc_armed_spin") else 0,
                                armed=name in ("cuda_ipc_armed", "cuda_ipc_armed_spin"))
    if plane == "host_ring":  # the ring client the fallback would make, with or without the stream
        client.ring = HostRingClient(endpoint, shape, client.buffers, max_batch=batch, transport=transport,
                                     timeout_s=args.timeout_s, stream=name != "host_ring_zmq",
                                     lanes={"host_ring_1lane": 1, "host_ring_8lane": 8}.get(name, STREAM_LANES),
                                     staging="step" if name == "host_ring_bulk" else "span",
                                     d2h_pieces=1 if name == "host_ring_bulk" else 0,
                                     lane_bytes=0 if name == "host_ring_spread" else rs.LANE_BYTES,
                                     reply_spin_us=SPIN_US if name == "host_ring_spin" else 0)
    try:
        got = client.bind()
    except BaseException:
        client.close()
        raise
    if got != plane:
        client.close()
        raise RuntimeError(f"asked for {plane}, bound {got}: {client.fallback_reason}")
    return client


def _release(client) -> None:
    """The client's session back to the drafter (its KV blocks: one failing plane must not starve the
    next), then its sockets closed."""
    try:
        client.detach()
    except Exception:  # noqa: BLE001 - a broken binding: its session expires on the drafter's side
        pass
    client.close()


def bound_client(endpoint: str, args, batch: int, columns: int, name: str) -> dict:
    """One bound session timed: p50/p99 of step() (drafts on the host), for the stamped planes the
    stages of the step, and for nccl_channel and cuda_ipc the host time of step_async on the target side."""
    client = open_client(endpoint, args, batch, columns, name)
    try:
        call = {k: ([t.to(args.device) for t in v] if isinstance(v, list) else v.to(args.device))
                for k, v in _call(args, batch).items()}
        n, b = fill(client.views, call)
        torch.cuda.synchronize()
        step = _stepper(client, call, n, b, name)
        result = {"rtt": _time(step, args.iters), "drafts": step().tolist()}
        if client.link is not None:  # the GPU planes: whether the header went by the doorbell
            result["doorbell"] = client.link.bell is not None
            result["doorbell_reason"] = client.link.bell_reason
            result["host_wait"] = getattr(client.link, "host_wait", False)
        elif client.ring is not None and client.ring.link is not None:  # the host ring: whether the stream carried it
            result["stream"] = client.ring.link.conn is not None
            result["stream_reason"] = client.ring.link.stream_reason
        if name in STAMPED:
            result["stages"] = stages(client, step, args.iters)
        if name in ("cuda_ipc", "cuda_ipc_zmq", "cuda_ipc_spin", "cuda_ipc_armed", "cuda_ipc_armed_spin",
                    "nccl_channel", "nccl_channel_ipc", "nccl_channel_zmq"):
            host = []
            stream = torch.cuda.current_stream()
            for i in range(WARMUP + args.iters):
                client.step_async(n, b)
                if i >= WARMUP:
                    host.append(client.host_ns / 1e3)
                stream.synchronize()  # the target consumes the drafts before its next step
            result["target_host"] = _stats(host)
            client.check()
        return result
    finally:
        _release(client)


STAGES = (  # (name, from stamp, to stamp): a stamped step's path, target -> drafter -> target
    ("target: header to socket", "sent", "received"),
    ("drafter: header read to step start", "received", "started"),
    ("drafter: step start to GPU work queued", "started", "queued"),
    ("drafter: queued to reply encoded", "queued", "replied"),
    ("reply to target", "replied", "answered"),
    ("target: reply to drafts on host", "answered", "read"),
    ("GPU tail: queued to drafts on host", "queued", "read"),
    ("whole step", "sent", "read"),
    # inside "step start to GPU work queued" where the drafter stamps it (wb.FINE_STAMPS: cuda_ipc)
    ("of which: start to the inputs event's wait queued", "started", "waited"),
    # the guard folded into the bound graphs (drafter.engine.bound.fold) has no call of its own: the
    # drafter stamps "guarded" at "waited"; a drafter before the fold stamped its sizes' fill and replay
    ("of which: the guard's own calls (0: inside the bound replay)", "waited", "guarded"),
    ("of which: the bound replay queued (the guard's launches first)", "guarded", "replayed"),
    ("of which: the done event recorded", "replayed", "queued"))
FINE = {"waited", "guarded", "replayed"}  # stamps an older drafter (or another plane) does not send
RING_STAGES = (  # a host_ring step's path (HostRingClient's stamps: BoundLink.stamps)
    ("target: step called to header sent (data socket: the D2H copy first)", "begin", "sent"),
    ("target: header sent to the prefix pushed (stream: the chunks' D2H copies inside)", "sent", "pushed"),
    ("target: header to the drafter's read", "sent", "received"),
    ("drafter: header read to the prefix landed in the ring", "received", "landed"),
    ("drafter: landed to step start (lock taken)", "landed", "started"),
    ("drafter: step start to GPU work queued (H2D rest, guard, graphs)", "started", "queued"),
    ("drafter: queued to reply encoded (GPU done, drafts read)", "queued", "replied"),
    ("reply to target", "replied", "answered"),
    ("target: reply to drafts in a tensor", "answered", "read"),
    ("whole step", "begin", "read"))


def _stepper(client, call: dict, n: int, b: int, name: str):
    """The timed step of client `name`: step() alone, or the call's copies into the buffers first
    (_fill)."""
    if not name.startswith("cuda_ipc_fill"):
        return lambda: client.step(n, b)

    def step():
        fill(client.views, call)
        return client.step(n, b)
    return step


def stages(client, step, iters: int) -> dict:
    """Medians (and p99) of each stage of a stamped (cuda_ipc, nccl_channel, host_ring) step from
    the two sides' stamps."""
    ring = client.plane == "host_ring"
    plan = RING_STAGES if ring else STAGES
    rows: dict[str, list[float]] = {name: [] for name, _, _ in plan}
    for _ in range(WARMUP):
        step()
    for _ in range(iters):
        step()
        st = client.ring.stamps if ring else client.stamps
        if not all(k in st for _, a, z in plan for k in (a, z) if k not in FINE):
            return {"error": f"unstamped reply: {sorted(st)}"}
        for name, a, z in plan:
            if a in st and z in st:
                rows[name].append((st[z] - st[a]) / 1e3)
    return {name: _stats(xs) for name, xs in rows.items() if xs}


def unbound_client(endpoint: str, args, batch: int, share_cuda: bool) -> dict:
    from coordinator.transport import ZmqDrafterClient

    client = ZmqDrafterClient(endpoint, timeout_s=30, share_cuda=share_cuda)
    try:
        client.attach(layout(endpoint, args))
        call = _call(args, batch)
        if share_cuda:
            call["target_hidden_states"] = call["target_hidden_states"].to(args.device)
        ids = iter(range(1, 10**9))
        result = {"rtt": _time(lambda: client.propose(request_id=next(ids), **call).draft_token_ids, args.iters)}
        if share_cuda:
            result["cuda_ipc_used"] = client.cuda.enabled
        return result
    finally:
        _release(client)


def table(result: dict) -> str:
    """The markdown summary: one row per batch and client."""
    meta = result["meta"]
    lines = [f"# Bound remote drafting vs in-process ({meta['device']}, {meta['date']})", "",
             f"Target on {meta['target_device']}, drafter on {meta['drafter_device']}; "
             f"EAGLE-3 Llama-3.1-8B shapes, k = {meta['k']}, ctx {meta['ctx']}; "
             "p50 / p99 in us; ratio = remote p50 / in-process trusted propose p50 "
             "(in brackets: / in-process bound call p50)", "",
             "| batch | path | p50 | p99 | ratio | target host time p50 / p99 |", "|---|---|---|---|---|---|"]
    for b, row in result["batches"].items():
        local = row["in_process"]
        for name in ("trusted_propose", "bound_propose"):
            lines.append(f"| {b} | in-process {name} | {local[name]['p50_us']:.0f} | {local[name]['p99_us']:.0f} | | |")
        for name, r in row.get("remote", {}).items():
            if "error" in r:
                lines.append(f"| {b} | {name} | failed: {r['error'][:80]} | | | |")
                continue
            host = r.get("target_host")
            host_text = f"{host['p50_us']:.1f} / {host['p99_us']:.1f}" if host else ""
            label = name + (" (doorbell)" if r.get("doorbell") else "") + (" (host waits)" if r.get("host_wait") else "") \
                + (" (stream)" if r.get("stream") else "")
            lines.append(f"| {b} | {label} | {r['rtt']['p50_us']:.0f} | {r['rtt']['p99_us']:.0f} | "
                         f"{r['ratio']:.2f} ({r['ratio_bound']:.2f}) | {host_text} |")
    lines += _guard_lines(result)
    lines += _stage_lines(result)
    lines += _targets_lines(result)
    return "\n".join(lines) + "\n"


def _guard_lines(result: dict) -> list[str]:
    rows = [(b, r["in_process"]) for b, r in result["batches"].items() if "guarded_bound" in r["in_process"]]
    if not rows:
        return []
    out = ["", "In-process, one process: the bound call alone, behind the step guard, and the guard's replay on "
               "the GPU (CUDA events): fused (Triton) and the torch reference", "",
           "| batch | bound p50 | guarded bound p50 / p99 | guard GPU us | reference guard GPU us |",
           "|---|---|---|---|---|"]
    for b, r in rows:
        g = r["guarded_bound"]
        out.append(f"| {b} | {r['bound_propose']['p50_us']:.0f} | {g['p50_us']:.0f} / {g['p99_us']:.0f} | "
                   f"{r['guard_gpu_us']:.1f} | {r.get('reference_guard_gpu_us', 0):.1f} |")
    return out


def _stage_lines(result: dict) -> list[str]:
    """Where the cuda_ipc step's microseconds go: a column per batch and client, p50 (p99) per stage."""
    rows = {f"{b} {name}": r["remote"][name].get("stages") for b, r in result["batches"].items()
            for name in STAMPED if "stages" in r.get("remote", {}).get(name, {})}
    rows = {key: st for key, st in rows.items() if st and "error" not in st}
    if not rows:
        return []
    out = ["", "Step stages (perf_counter_ns on both sides, one host clock): p50 (p99) us", "",
           "| stage | " + " | ".join(f"batch {key}" for key in rows) + " |", "|---|" + "---|" * len(rows)]
    for name in dict.fromkeys(n for n, _, _ in (*STAGES, *RING_STAGES)):
        if not any(name in st for st in rows.values()):
            continue
        out.append(f"| {name} | " + " | ".join(f"{st[name]['p50_us']:.0f} ({st[name]['p99_us']:.0f})" if name in st
                                              else "" for st in rows.values()) + " |")
    return out




def _targets_lines(result: dict) -> list[str]:
    run = result.get("targets")
    if not run:
        return []
    out = ["", f"Several targets: {run['n']} target processes on {result['meta']['target_device']}, one drafter on "
               f"{result['meta']['drafter_device']}, each one bound session over {run['plane']} at batch "
               f"{run['batch']}, started together; step time in us", "",
           "| targets | target | p50 | p99 | p50 / one target alone |", "|---|---|---|---|---|"]
    alone = run.get("alone", {}).get("p50_us")
    for key in ("alone_run", "together"):
        for i, r in enumerate(run.get(key, [])):
            if "error" in r:
                out.append(f"| {1 if key == 'alone_run' else run['n']} | {i} | failed: {r['error'][:80]} | | |")
                continue
            ratio = f"{r['rtt']['p50_us'] / alone:.2f}" if alone else ""
            out.append(f"| {1 if key == 'alone_run' else run['n']} | {i} | {r['rtt']['p50_us']:.0f} | "
                       f"{r['rtt']['p99_us']:.0f} | {ratio} |")
    return out


def _line(proc: subprocess.Popen, timeout_s: float) -> dict:
    """The next JSON line a target process prints, within timeout_s (RuntimeError otherwise)."""
    import select

    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            raise RuntimeError(f"a target process said nothing in {timeout_s} s")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a target process exited with {proc.wait()}")
        try:
            return json.loads(line)
        except ValueError:
            continue


def several_targets(endpoint: str, args, columns: int, log) -> dict:
    """One target process alone, then args.targets together, against the one drafter: each one's
    step time (p50 / p99 of step(), drafts on the host)."""
    spec = {"endpoint": endpoint, "batch": args.targets_batch, "plane": args.targets_plane, "iters": args.iters,
            "device": args.device, "k": args.k, "ctx": args.ctx, "head": args.head,
            "session_blocks": args.session_blocks, "columns": columns, "timeout_s": args.timeout_s}
    run = {"n": args.targets, "plane": args.targets_plane, "batch": args.targets_batch}
    for key, count in (("alone_run", 1), ("together", args.targets)):
        procs = [subprocess.Popen([sys.executable, "-m", "coordinator.bench.bound", "target", json.dumps(spec)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(count)]
        try:
            ready = [_line(p, 120) for p in procs]
            bad = [r for r in ready if "error" in r]
            if bad:
                run[key] = bad
                log(f"targets {count}: FAILED {bad[0]['error']}")
                continue
            for p in procs:  # every target bound and warm: all start their timed steps now
                p.stdin.write("go\n")
                p.stdin.flush()
            run[key] = [_line(p, 300) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.stdin.close() if not p.stdin.closed else None
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        p.kill()
        for i, r in enumerate(run[key]):
            if "rtt" in r:
                log(f"targets {count}, target {i}: p50 {r['rtt']['p50_us']:.0f} us, p99 {r['rtt']['p99_us']:.0f} us")
    alone = run.get("alone_run", [{}])[0]
    if "rtt" in alone:
        run["alone"] = alone["rtt"]
    return run


def target_main(spec_json: str) -> int:
    """One target process of the several-targets run: bind, warm up, say ready; on "go" time the steps."""
    spec = json.loads(spec_json)
    args = SimpleNamespace(**spec)
    try:
        client = open_client(args.endpoint, args, args.batch, args.columns, args.plane)
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    try:
        n, b = fill(client.views, _call(args, args.batch))
        for _ in range(WARMUP):
            client.step(n, b)
        print(json.dumps({"ready": True}), flush=True)
        if not sys.stdin.readline():
            return 1
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            client.step(n, b)
            times.append((time.perf_counter() - t0) * 1e6)
        print(json.dumps({"rtt": _stats(times)}), flush=True)
        return 0
    finally:
        _release(client)



def run_client(endpoint: str, args, columns: int, name: str, result: dict, log, save, server=None) -> None:
    """One client at every batch, the results saved after each; after a timeout the served drafter
    (server: its process) is asked to print every thread's stack to its stderr (SIGUSR1), which
    the bench's output keeps."""
    for b in args.batches:
        remote_client(endpoint, args, b, columns, name, result["batches"][b], log)
        save()
        failed = result["batches"][b]["remote"].get(name, {}).get("error", "")
        if server is not None and "DEADLINE_EXCEEDED" in failed and server.poll() is None:
            server.send_signal(signal.SIGUSR1)


def remote_client(endpoint: str, args, b: int, columns: int, name: str, row: dict, log) -> None:
    """One client at one batch timed into row["remote"][name] (its error where it failed)."""
    try:
        if name in BOUND:
            r = bound_client(endpoint, args, b, columns, name)
        else:
            r = unbound_client(endpoint, args, b, share_cuda=name == "unbound_cuda_ipc")
    except Exception as exc:  # noqa: BLE001 - one path failing keeps the others' figures
        row["remote"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"batch {b} {name}: FAILED {type(exc).__name__}: {exc}")
        return
    r["ratio"] = r["rtt"]["p50_us"] / row["in_process"]["trusted_propose"]["p50_us"]
    r["ratio_bound"] = r["rtt"]["p50_us"] / row["in_process"]["bound_propose"]["p50_us"]
    row["remote"][name] = r
    host = r.get("target_host")
    if r.get("doorbell_reason") and name not in NO_DOORBELL and name not in RINGS:
        log(f"batch {b} {name}: no doorbell: {r['doorbell_reason']}")
    if r.get("stream_reason") and name != "host_ring_zmq":
        log(f"batch {b} {name}: no ring stream: {r['stream_reason']}")
    log(f"batch {b} {name}: p50 {r['rtt']['p50_us']:.0f} us, p99 {r['rtt']['p99_us']:.0f} us, "
        f"ratio {r['ratio']:.2f} (vs bound {r['ratio_bound']:.2f})"
        + (f", target host time p50 {host['p50_us']:.1f} us p99 {host['p99_us']:.1f} us" if host else ""))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["target"]:
        return target_main(argv[1])
    p = argparse.ArgumentParser(prog="python -m coordinator.bench.bound", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/latest")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--kv-blocks", type=int, default=32768)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--device", default="cuda:0", help="the target's GPU (and the in-process calls') [cuda:0]")
    p.add_argument("--drafter-device", default="", help="the served drafter's GPU [--device]")
    p.add_argument("--clients", default="", help=f"of {CLIENTS} [nccl_channel,cuda_ipc,host_ring with the "
                                                 "drafter on another GPU, else every other one]")
    p.add_argument("--targets", type=int, default=0, help="N >= 2: the several-targets run as well")
    p.add_argument("--targets-plane", default="", help="nccl_channel or cuda_ipc or host_ring "
                                                       "[nccl_channel with the drafter on another GPU, else cuda_ipc]")
    p.add_argument("--targets-batch", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=30.0, help="each bound client's step deadline and channel join")
    p.add_argument("--tiny", action="store_true", help="a tiny head (a quick check of this script)")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.drafter_device = args.drafter_device or args.device
    apart = args.drafter_device != args.device
    args.clients = [c for c in (args.clients or ("nccl_channel,cuda_ipc,host_ring" if apart else ",".join(
        c for c in CLIENTS if c != "nccl_channel"))).split(",") if c]
    args.targets_plane = args.targets_plane or ("nccl_channel" if apart else "cuda_ipc")
    if args.targets == 1 or args.targets < 0 or args.targets_plane not in BOUND \
            or (args.targets and not 0 < args.targets_batch <= max(args.batches)):
        raise SystemExit("--targets: 0 or N >= 2; --targets-plane: one of " + ",".join(BOUND)
                         + "; --targets-batch: at most the largest of --batches (the drafter's max_num_seqs)")
    unknown = set(args.clients) - set(CLIENTS)
    if unknown:
        raise SystemExit(f"--clients: unknown {sorted(unknown)}; choose from {CLIENTS}")
    args.head = {**HEAD_CONFIG, **(TINY if args.tiny else {})}
    args.session_blocks = args.kv_blocks // 4
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    model_dir = tempfile.mkdtemp(prefix="eagle3-8b-config-")
    Path(model_dir, "config.json").write_text(json.dumps(args.head))
    device_name = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu"
    if apart and args.drafter_device.startswith("cuda"):
        device_name += " + " + torch.cuda.get_device_name(torch.device(args.drafter_device))
    result = {"meta": {"device": device_name, "date": datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC"), "k": args.k, "ctx": args.ctx, "torch": torch.__version__,
        "target_device": args.device, "drafter_device": args.drafter_device,
        "command": "python -m coordinator.bench.bound " + " ".join(argv)}, "batches": {}}

    def save():
        (out / "bound.json").write_text(json.dumps(result, indent=1))
        (out / "bound.md").write_text(table(result))
        (out / "bound_log.txt").write_text("\n".join(lines) + "\n")

    local, columns = in_process(model_dir, args, log)
    for b in args.batches:
        result["batches"][b] = {"in_process": local[b], "remote": {}}
    save()
    proc, endpoint = start_server(model_dir, args, log)
    try:
        # cuda_ipc across two GPUs last: a client that breaks the drafter spoils nothing measured before it
        risky = [c for c in args.clients if c.startswith("cuda_ipc") and args.drafter_device != args.device]
        for name in [c for c in args.clients if c not in risky]:  # every batch of one plane, then the next
            run_client(endpoint, args, columns, name, result, log, save, proc)
        if args.targets:
            try:
                result["targets"] = several_targets(endpoint, args, columns, log)
            except Exception as exc:  # noqa: BLE001 - what was measured stays
                result["targets"] = {"n": args.targets, "plane": args.targets_plane, "batch": args.targets_batch,
                                     "error": f"{type(exc).__name__}: {exc}"}
                log(f"several targets: FAILED {type(exc).__name__}: {exc}")
            save()
        for name in risky:
            run_client(endpoint, args, columns, name, result, log, save, proc)
        for b in args.batches:
            bound = {k: v.get("drafts") for k, v in result["batches"][b]["remote"].items() if "drafts" in v}
            if len(set(json.dumps(v) for v in bound.values())) > 1:
                log(f"batch {b}: the bound planes drafted differently: {sorted(bound)}")
    finally:
        stop_child(proc)
        save()
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
