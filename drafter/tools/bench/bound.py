"""The drafter's half of the bound-session bench: in-process timings and the served drafter.

    python -m coordinator.bench.bound --out DIR [--batches 1,16,64 --k 3 --ctx 1024 --iters 300
                                                 --device cuda:0 --drafter-device cuda:1 --targets 2]

The CLI and the clients (the target's side) live in coordinator.bench.bound: the drafter package
never imports coordinator.  Here, EAGLE-3 / Llama-3.1-8B shapes with random weights (only
config.json is written; each process builds the weights on its GPU):

  * in_process: per batch, in this process on the target's GPU, the trusted
    `propose(validate=False)` on GPU inputs and the in-process bound call (engine.bind, then
    bound.propose), each with the drafts copied to the host; and the bound call behind the step
    guard (drafter.engine.step_guard over a device slab laid out as the remote target's, the
    engine bound to its outputs, the guard folded into the bound graphs as the service does) with
    the guard's own graph replayed alone (CUDA events): what the guard adds without any second
    process;
  * start_server: one `drafter serve` process on the drafter's GPU (CUDA IPC allowed) with every
    batch captured, which the clients then attach to.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time

import torch

from drafter.tools.bench.grid import bind_call, decode_call
from drafter.tools.bench.remote import HEAD_CONFIG, TINY, _build, server_args, wait_ready  # noqa: F401 (the CLI's)

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


def engine_args(model_dir: str, args, device: str) -> list[str]:
    """`drafter serve` arguments for an engine on `device`: one engine for every batch (each
    captured), CUDA IPC allowed."""
    top = max(args.batches)
    argv = server_args(model_dir, top, args.k, args.ctx, args.kv_blocks, device)
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
    return _build(engine_config(from_args(p.parse_args(engine_args(model_dir, args, args.device)))), model_dir)


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
    target's; the guard's outputs and the slab's hidden states bound, the guard folded into the
    bound graphs as the service does: one replay a step): its time with the drafts on the host,
    and the guard's own graph replayed alone on the GPU (CUDA events, mean of args.iters: the
    GPU time the guard's launches add inside the bound replay); its drafts must equal the
    unguarded bound call's."""
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
    guard.capture()  # its own graph, for its GPU time alone below
    o = guard.out
    drafts = torch.zeros(batch, engine.graphs.width, dtype=torch.int64, device=engine.device)  # [batch, width]
    bound = engine.bind(target_token_ids=o["target_token_ids"], target_positions=o["target_positions"],
                        target_hidden_states=views[wb.HIDDEN], next_token_ids=o["next_token_ids"],
                        query_start_loc=o["query_start_loc"], seq_lens=o["seq_lens"],
                        block_tables=[o["block_tables[0]"]], slot_mappings=[o["slot_mappings[0]"]],
                        num_rejected_tokens=o["num_rejected_tokens"], drafts=drafts)
    bound.fold(guard)

    def step():
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
    """`drafter serve` (random weights) on args.drafter_device; (process, its tcp endpoint)."""
    run_dir = tempfile.mkdtemp(prefix="drafter-bound-")
    cmd = [sys.executable, "-m", "drafter.tools.bench.remote", "serve", *engine_args(model_dir, args, args.drafter_device),
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


def main(argv: list[str] | None = None) -> int:
    """The bench's CLI moved to the client side (it drives clients): say where."""
    print("the bound-session bench runs as: python -m coordinator.bench.bound --out DIR ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
