"""Bound remote drafting vs in-process on one GPU host: the cuda_ipc plane, the host ring, unbound.

    python -m drafter.tools.bench.bound --out DIR [--batches 1,16,64 --k 3 --ctx 1024 --iters 300]

EAGLE-3 / Llama-3.1-8B shapes with random weights (only config.json is written; each process
builds the weights on the GPU).  First, in this process, per batch: the trusted in-process
`propose(validate=False)` on GPU inputs and the in-process bound call (engine.bind, then
bound.propose), each with the drafts copied to the host.  Then the engine is freed and one
`drafter serve` process starts on the same GPU (CUDA IPC allowed) with every batch captured, and
per batch these clients attach a session and time the same decode step:

  * cuda_ipc: coordinator.transport.bound_ipc over CUDA IPC (header-only steps, drafts and the
    error word read back together); also its host time per step on the target side (the step
    without the wait for the reply, from step_async);
  * cuda_ipc_host_wait: the same, the target's host waiting on the drafter's event before its
    read instead of its stream (host_wait=True: no work of the target's context pending while
    the drafter's kernels run);
  * host_ring: the same client forced onto the host ring over tcp (one device-to-host copy of the
    slab's prefix, one zero-copy frame);
  * unbound: today's ZmqDrafterClient over tcp (the CPU tensors encoded per call), and with the
    hidden states as a per-step CUDA IPC reference (unbound_cuda_ipc).

In-process also: the bound call behind the cuda_ipc plane's step guard (drafter.engine.step_guard
captured over a device slab laid out as the remote target's, the engine bound to its outputs),
and the guard's replay alone (CUDA events): what the guard adds without any second process.
The cuda_ipc steps are stamped on both sides (perf_counter_ns, CLOCK_MONOTONIC: one clock for
both processes): the medians of each stage, "where the microseconds go", in bound.md.

Reported: p50 / p99 of each, remote p50 / in-process p50 (against the trusted propose and against
the in-process bound call), the cuda_ipc host time p50 / p99; bound.json and bound.md in --out,
rewritten after every batch (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from drafter.tools.bench.grid import bind_call, decode_call
from drafter.tools.bench.remote import HEAD_CONFIG, TINY, _build, server_args, wait_ready

CLIENTS = ("cuda_ipc", "cuda_ipc_host_wait", "host_ring", "unbound", "unbound_cuda_ipc")
WARMUP = 30


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50_us": xs[len(xs) // 2], "p99_us": xs[min(len(xs) - 1, int(0.99 * len(xs)))], "n": len(xs)}


def _time(fn, iters: int, warmup: int = WARMUP) -> dict:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return _stats(out)


def engine_args(model_dir: str, args) -> list[str]:
    """`drafter serve` arguments: one engine for every batch (each captured), CUDA IPC allowed."""
    top = max(args.batches)
    argv = server_args(model_dir, top, args.k, args.ctx, args.kv_blocks, args.device)
    sizes = {"--capture-sizes": ",".join(map(str, args.batches)),
             "--token-capture-sizes": ",".join(str(b * (args.k + 1)) for b in args.batches),
             "--max-sessions": "8"}
    for flag, value in sizes.items():
        argv[argv.index(flag) + 1] = value
    return argv


def _engine(model_dir: str, args):
    from drafter.service.config import add_arguments, from_args
    from drafter.service.server import engine_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    return _build(engine_config(from_args(p.parse_args(engine_args(model_dir, args)))), model_dir)


def _call(args, batch: int) -> dict:
    return decode_call(batch, args.k, args.ctx, args.session_blocks, args.head["vocab_size"],
                       3 * args.head["hidden_size"], torch.bfloat16, seed=7)


def in_process(model_dir: str, args, log) -> tuple[dict, int]:
    """Per batch: the trusted propose and the bound call, drafts to the host; and the engine's
    block-table width (the bound clients' tables are as wide)."""
    engine = _engine(model_dir, args)
    dev = engine.device
    out = {}
    for b in args.batches:
        gpu = {k: ([t.to(dev) for t in v] if isinstance(v, list) else v.to(dev)) for k, v in _call(args, b).items()}
        trusted = _time(lambda: engine.propose(**gpu, validate=False).draft_token_ids.cpu(), args.iters)
        n = gpu["target_token_ids"].shape[0]
        if engine.graphs is not None:  # a bound call replays the engine's graphs: a GPU
            bound = bind_call(engine, gpu)
            bound_t = _time(lambda: bound.propose(n, b)[:b].cpu(), args.iters)
            drafts = bound.propose(n, b)[:b].cpu()
            del bound
        else:  # a CPU smoke run of this script: no graphs, the trusted call stands in
            bound_t = trusted
        out[b] = {"trusted_propose": trusted, "bound_propose": bound_t}
        log(f"batch {b}: in-process propose p50 {trusted['p50_us']:.0f} us (p99 {trusted['p99_us']:.0f}), "
            f"bound {bound_t['p50_us']:.0f} us (p99 {bound_t['p99_us']:.0f})")
        if engine.graphs is not None:
            try:
                out[b].update(guarded(engine, args, b, drafts))
            except Exception as exc:  # noqa: BLE001 - the remote figures still come
                log(f"batch {b}: guarded in-process FAILED {type(exc).__name__}: {exc}")
                continue
            log(f"batch {b}: in-process guarded bound p50 {out[b]['guarded_bound']['p50_us']:.0f} us, "
                f"guard replay alone {out[b]['guard_gpu_us']:.1f} us (GPU; fused {out[b]['fused_guard']}), "
                f"the torch reference guard {out[b].get('reference_guard_gpu_us', 0):.1f} us")
    width = engine.config.max_blocks_per_req[0]
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out, width


def guarded(engine, args, batch: int, want: torch.Tensor) -> dict:  # want: [batch, width] the bound call's drafts
    """The bound call behind the step guard, in this process (a slab laid out as the remote
    target's; the guard's outputs and the slab's hidden states bound): its time with the drafts
    on the host, and the guard's replay alone on the GPU (CUDA events, mean of args.iters); its
    drafts must equal the unguarded bound call's."""
    from drafter.engine.step_guard import GuardLimits, StepGuard
    from drafter.wire import bound as wb
    from drafter.wire.tensors import DTYPES

    columns = engine.config.max_blocks_per_req[0]
    slots, total = wb.ring_layout(buffers(args, batch, columns), lambda d: DTYPES[d].itemsize)
    slab = torch.zeros(total, dtype=torch.uint8, device=engine.device)  # [total]: the target's buffers
    views = {sl.name: slab[sl.offset:sl.offset + sl.nbytes].view(DTYPES[sl.dtype]).view(sl.shape) for sl in slots}
    n, b = fill(views, _call(args, batch))
    limits = GuardLimits(vocab_size=args.head["vocab_size"], max_model_len=engine.config.max_model_len,
                         num_speculative_tokens=args.k, num_blocks=(args.session_blocks,),
                         block_sizes=(engine.config.kv_groups[0].block_size,), bases=(0,))
    error = torch.zeros(1, dtype=torch.int64, device=engine.device)  # [1]
    guard = StepGuard(views, limits, error)
    guard.capture()
    o = guard.out
    drafts = torch.zeros(batch, engine.graphs.width, dtype=torch.int64, device=engine.device)  # [batch, width]
    bound = engine.bind(target_token_ids=o["target_token_ids"], target_positions=o["target_positions"],
                        target_hidden_states=views[wb.HIDDEN], next_token_ids=o["next_token_ids"],
                        query_start_loc=o["query_start_loc"], seq_lens=o["seq_lens"],
                        block_tables=[o["block_tables[0]"]], slot_mappings=[o["slot_mappings[0]"]],
                        num_rejected_tokens=o["num_rejected_tokens"], drafts=drafts)

    def step():
        guard.step(n, b)
        return bound.propose(n, b)[:b].cpu()

    timed = _time(step, args.iters)
    if not torch.equal(step(), want):
        raise RuntimeError("the guarded bound call drafted other drafts than the bound call")
    if engine.device.type != "cuda":  # a CPU check of this script: no GPU time to take
        return {"guarded_bound": timed, "guard_gpu_us": 0.0, "fused_guard": guard.fused}
    gpu_us = _replay_us(guard, n, b, args.iters)
    if int(error.item()):  # the bench's call is in range: a set word is a bug of the guard
        raise RuntimeError(f"the guard flagged the bench's own step: word {int(error.item())}")
    reference = StepGuard(views, limits, torch.zeros(1, dtype=torch.int64, device=engine.device), fused=False)
    reference.capture()  # the torch ops of run_reference, captured as the first cuda_ipc build did
    return {"guarded_bound": timed, "guard_gpu_us": gpu_us, "fused_guard": guard.fused,
            "reference_guard_gpu_us": _replay_us(reference, n, b, args.iters)}


def _replay_us(guard, n: int, b: int, iters: int) -> float:
    """Mean GPU time of guard.step over iters back-to-back steps (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        guard.step(n, b)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def start_server(model_dir: str, args, log):
    run_dir = tempfile.mkdtemp(prefix="drafter-bound-")
    cmd = [sys.executable, "-m", "drafter.tools.bench.remote", "serve", *engine_args(model_dir, args),
           "--zmq-ipc", f"{run_dir}/drafter.sock"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        ev = wait_ready(proc)
    except RuntimeError:
        proc.kill()
        raise
    log(f"server ready: zmq {ev['zmq_port']}")
    return proc, f"tcp://127.0.0.1:{ev['zmq_port']}"


def buffers(args, batch: int, columns: int):
    """The target's persistent buffers for a batch: int64 tokens, int32 tables, bf16 hidden states."""
    from drafter.wire import bound as wb

    t = batch * (args.k + 1)
    return [wb.BufferSpec("target_token_ids", "int64", [t]), wb.BufferSpec("target_positions", "int64", [t]),
            wb.BufferSpec(wb.HIDDEN, "bfloat16", [t, 3 * args.head["hidden_size"]]),
            wb.BufferSpec("next_token_ids", "int64", [batch]), wb.BufferSpec("query_start_loc", "int32", [batch + 1]),
            wb.BufferSpec("seq_lens", "int32", [batch]), wb.BufferSpec("num_rejected_tokens", "int32", [batch]),
            wb.BufferSpec("block_tables[0]", "int32", [batch, columns]),
            wb.BufferSpec("slot_mappings[0]", "int64", [t])]


def fill(views: dict, call: dict) -> tuple[int, int]:
    """The call written into the target's buffers (tables into their first columns); (tokens, batch)."""
    for name, value in call.items():
        for i, src in enumerate(value if isinstance(value, list) else [value]):
            dst = views[f"{name}[{i}]" if isinstance(value, list) else name]
            dst[tuple(slice(0, s) for s in src.shape)].copy_(src.to(dst.device))
    return call["target_token_ids"].shape[0], call["next_token_ids"].shape[0]


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


def bound_client(endpoint: str, args, batch: int, columns: int, name: str) -> dict:
    """One bound session timed: p50/p99 of step() (drafts on the host), for the cuda_ipc plane the
    stages of the step, and for cuda_ipc the host time of step_async on the target side."""
    from coordinator.transport.bound_ipc import CudaIpcBoundClient

    plane = "host_ring" if name == "host_ring" else "cuda_ipc"
    client = CudaIpcBoundClient(endpoint, layout(endpoint, args), buffers(args, batch, columns), max_batch=batch,
                                device=args.device, timeout_s=30, allow_fallback=False,
                                force_ring=plane == "host_ring", host_wait=name == "cuda_ipc_host_wait")
    try:
        got = client.bind()
        if got != plane:
            raise RuntimeError(f"asked for {plane}, bound {got}: {client.fallback_reason}")
        n, b = fill(client.views, _call(args, batch))
        torch.cuda.synchronize()
        result = {"rtt": _time(lambda: client.step(n, b), args.iters), "drafts": client.step(n, b).tolist()}
        if plane == "cuda_ipc":
            result["stages"] = stages(client, n, b, args.iters)
        if name == "cuda_ipc":
            host = []
            stream = torch.cuda.current_stream()
            for i in range(WARMUP + args.iters):
                client.step_async(n, b)
                if i >= WARMUP:
                    host.append(client.host_ns / 1e3)
                stream.synchronize()  # the target consumes the drafts before its next step
            result["target_host"] = _stats(host)
            client.check()
        client.detach()
        return result
    finally:
        client.close()


STAGES = (  # (name, from stamp, to stamp): the cuda_ipc step's path, target -> drafter -> target
    ("target: header to socket", "sent", "received"),
    ("drafter: header read to step start", "received", "started"),
    ("drafter: step start to GPU work queued", "started", "queued"),
    ("drafter: queued to reply encoded", "queued", "replied"),
    ("reply to target", "replied", "answered"),
    ("target: reply to drafts on host", "answered", "read"),
    ("GPU tail: queued to drafts on host", "queued", "read"),
    ("whole step", "sent", "read"))


def stages(client, n: int, b: int, iters: int) -> dict:
    """Medians (and p99) of each stage of the cuda_ipc step from the two sides' stamps."""
    rows: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    for _ in range(WARMUP):
        client.step(n, b)
    for _ in range(iters):
        client.step(n, b)
        st = client.stamps
        if not all(k in st for _, a, z in STAGES for k in (a, z)):
            return {"error": f"unstamped reply: {sorted(st)}"}
        for name, a, z in STAGES:
            rows[name].append((st[z] - st[a]) / 1e3)
    return {name: _stats(xs) for name, xs in rows.items()}


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
        client.detach()
        return result
    finally:
        client.close()


def table(result: dict) -> str:
    """The markdown summary: one row per batch and client."""
    lines = [f"# Bound remote drafting vs in-process ({result['meta']['device']}, {result['meta']['date']})", "",
             f"EAGLE-3 Llama-3.1-8B shapes, k = {result['meta']['k']}, ctx {result['meta']['ctx']}; "
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
            lines.append(f"| {b} | {name} | {r['rtt']['p50_us']:.0f} | {r['rtt']['p99_us']:.0f} | "
                         f"{r['ratio']:.2f} ({r['ratio_bound']:.2f}) | {host_text} |")
    lines += _guard_lines(result)
    lines += _stage_lines(result)
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
            for name in ("cuda_ipc", "cuda_ipc_host_wait") if "stages" in r.get("remote", {}).get(name, {})}
    rows = {key: st for key, st in rows.items() if st and "error" not in st}
    if not rows:
        return []
    out = ["", "cuda_ipc step stages (perf_counter_ns on both sides, one host clock): p50 (p99) us", "",
           "| stage | " + " | ".join(f"batch {key}" for key in rows) + " |", "|---|" + "---|" * len(rows)]
    for name, _, _ in STAGES:
        out.append(f"| {name} | " + " | ".join(f"{st[name]['p50_us']:.0f} ({st[name]['p99_us']:.0f})"
                                              for st in rows.values()) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m drafter.tools.bench.bound", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/latest")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--kv-blocks", type=int, default=32768)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--tiny", action="store_true", help="a tiny head (a quick check of this script)")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.clients = [c for c in args.clients.split(",") if c]
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
    result = {"meta": {"device": device_name, "date": datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC"), "k": args.k, "ctx": args.ctx, "torch": torch.__version__,
        "command": "python -m drafter.tools.bench.bound " + " ".join(argv)}, "batches": {}}

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
        for b in args.batches:
            row = result["batches"][b]
            for name in args.clients:
                try:
                    if name in ("cuda_ipc", "cuda_ipc_host_wait", "host_ring"):
                        r = bound_client(endpoint, args, b, columns, name)
                    else:
                        r = unbound_client(endpoint, args, b, share_cuda=name == "unbound_cuda_ipc")
                except Exception as exc:  # noqa: BLE001 - one path failing keeps the others' figures
                    row["remote"][name] = {"error": f"{type(exc).__name__}: {exc}"}
                    log(f"batch {b} {name}: FAILED {type(exc).__name__}: {exc}")
                    continue
                r["ratio"] = r["rtt"]["p50_us"] / row["in_process"]["trusted_propose"]["p50_us"]
                r["ratio_bound"] = r["rtt"]["p50_us"] / row["in_process"]["bound_propose"]["p50_us"]
                row["remote"][name] = r
                host = r.get("target_host")
                log(f"batch {b} {name}: p50 {r['rtt']['p50_us']:.0f} us, p99 {r['rtt']['p99_us']:.0f} us, "
                    f"ratio {r['ratio']:.2f} (vs bound {r['ratio_bound']:.2f})"
                    + (f", target host time p50 {host['p50_us']:.1f} us p99 {host['p99_us']:.1f} us" if host else ""))
                save()
            bound = {k: v.get("drafts") for k, v in row["remote"].items() if "drafts" in v}
            if len(set(json.dumps(v) for v in bound.values())) > 1:
                log(f"batch {b}: the bound planes drafted differently: {sorted(bound)}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        save()
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
