"""`drafter bench --tensor-parallel-size N`: one head's propose call split over N ranks, timed.

    python -m drafter.tools.bench.tp --tensor-parallel-size 1,2 --out bench/results/tp2   # N = 1, then 2
    drafter bench --tensor-parallel-size 1 --heads deepseek-v3-mtp --batches 1,8,64 --ks 1 --contexts 1024
(`drafter bench` takes its own defaults for batches, k and contexts: pass them.)

Spawns N rank processes (rank r on cuda:r with NCCL; on --device cpu, gloo ranks on the host) that
join one process group through a TCPStore on loopback, the way `drafter serve
--tensor-parallel-size N` does (drafter.service.tp), each building its shard of the head with
random weights straight on its device (drafter.models.sharding / llama_shard / the DeepSeek
Shard), then all ranks run the same decode calls in lockstep (every request verified k+1 tokens
at position ctx - 1).  At N = 1 it is the same code with a process group of one.

Heads:
  deepseek-v3-mtp  DeepSeek-V3's MTP layer as released: hidden 7168, 128 MLA heads (q / kv ranks
                   1536 / 512, rope 64), 256 experts top-8 in 8 groups, 1 shared, expert
                   intermediate 2048, vocabulary 129280, FP8 128x128 blocks (--deepseek-weights bf16:
                   dequantised); attention heads, experts and vocabulary split over ranks
  eagle3-70b       an EAGLE-3 head for Llama-3.3-70B: hidden 8192, 64 heads / 8 KV heads of 128,
                   intermediate 28672, draft vocabulary 32000 (target 128256), bf16
  deepseek-tiny, eagle3-tiny   the same code at make-tiny sizes (a CPU smoke run)
--tensor-parallel-size takes a list (1,2): each N in turn on the same machine (per head: all N for
one head, then the next), and the rows of N > 1 carry speedup = the N = 1 row's propose_us / theirs.

Per row (head, k, ctx, batch, world): propose_us (rank 0: the whole call, i.e. one drafter step of
k forward passes, through CUDA graphs on a GPU at any N: the sharded step is captured with its
NCCL collectives inside), eager_us (graphs off), propose_max_us (the slowest rank), bcast_us (one
broadcast of the call's tensors packed as serve's leader sends them), nccl_us (N > 1: the step's
collectives alone, the same kinds, shapes and order as one step issues them, replayed in one CUDA
graph), drafts_agree (every rank drafted the same tokens), weight_bytes and peak_bytes per rank
(max over ranks), floor_weights_us (all of a rank's weight bytes at the measured copy bandwidth),
and floor_us / step_over_floor: floor_bytes, what one rank must read for the step (per forward
pass: its dense weights, the embedding rows of its tokens, its routed experts that the pass's
tokens hit in expectation under uniform routing, E_local * (1 - (1 - top_k / E) ** tokens), fc on
the first pass only, MLA's absorbed W_UK / W_UV instead of kv_b_proj, and its KV cache for
batch * ctx tokens), over the copy bandwidth (GPU only).
Each row is appended to OUT/rows.jsonl and printed as soon as all ranks measured it (a run cut
short keeps its rows; `--table OUT/rows.jsonl` prints them as markdown); OUT/bench_tp.json and
bench_tp.md (the same table) hold them all at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.models.layers import LayerShape
from drafter.models.sharding import Shard, recording
from drafter.models.spec import ModelSpec
from drafter.tools.bench.grid import random_kv

BLOCK_SIZE = 16
HEADS = ("deepseek-v3-mtp", "eagle3-70b", "deepseek-tiny", "eagle3-tiny")
DEFAULT_HEADS = "deepseek-v3-mtp,eagle3-70b"


def eagle3_spec(tiny: bool) -> ModelSpec:
    if tiny:
        layer = LayerShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                           rms_norm_eps=1e-5, rope_theta=500000.0)
        return ModelSpec(method="eagle3", hidden_size=64, num_layers=1, vocab_size=512, layer_shapes=(layer,),
                         draft_vocab_size=128, aux_layer_ids=(1, 2, 3), target_hidden_size=64)
    layer = LayerShape(hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=28672,
                       rms_norm_eps=1e-5, rope_theta=500000.0)
    return ModelSpec(method="eagle3", hidden_size=8192, num_layers=1, vocab_size=128256, layer_shapes=(layer,),
                     draft_vocab_size=32000, aux_layer_ids=(2, 40, 77), target_hidden_size=8192)


def deepseek_config(tiny: bool, fp8: bool):
    from drafter.models.deepseek_config import DEEPSEEK_V3, parse_deepseek

    if tiny:
        from drafter.models.tiny_deepseek import TinyDeepseekSizes
        from drafter.models.tiny_deepseek import deepseek_config as tiny_config

        cfg = parse_deepseek(tiny_config(TinyDeepseekSizes(fp8_block=(8, 16))))
    else:
        cfg = parse_deepseek(DEEPSEEK_V3)
    return cfg if fp8 else replace(cfg, fp8_block=None)


@torch.no_grad()
def _init_llama_head(head: nn.Module, seed: int) -> None:
    g = torch.Generator(device=next(head.parameters()).device).manual_seed(seed)
    for name, p in head.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0)  # norms
        else:
            p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
    for b in head.buffers():
        b.zero_()  # d2t: draft id i is target id i


@torch.no_grad()
def _init_deepseek_head(head: nn.Module, seed: int) -> None:
    from drafter.models.fp8 import FP8, FP8Linear

    device = next(head.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    for module in head.modules():
        if isinstance(module, FP8Linear):
            w = torch.randn(module.weight.shape, device=device, dtype=torch.bfloat16, generator=g)
            module.weight.copy_(w.to(FP8))
            module.weight_scale_inv.fill_(module.in_features ** -0.5)
        elif isinstance(module, nn.Linear):
            module.weight.normal_(0, module.in_features ** -0.5, generator=g)
    for name, p in head.named_parameters():
        if name.endswith("embed_tokens.weight"):
            p.normal_(generator=g)
        elif "norm" in name:
            p.fill_(1.0)
        elif name.endswith("gate.weight"):
            p.normal_(0, p.shape[1] ** -0.5, generator=g)
    for layer in head.layers:
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.01, generator=g)


def build_head(name: str, shard: Shard, device: torch.device, dtype: torch.dtype, fp8: bool):
    """(head, the engine's spec for it): this rank's shard with random weights, made on `device`."""
    tiny = name.endswith("-tiny")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if name.startswith("eagle3"):
            from drafter.models.heads import Eagle3Head
            from drafter.models.llama_shard import shard_spec

            spec = shard_spec(eagle3_spec(tiny), shard)
            with torch.device(device):
                head = Eagle3Head(spec, shard)
            _init_llama_head(head, seed=1)
            return head.eval(), spec
        from drafter.models.deepseek_loader import deepseek_model_spec
        from drafter.models.deepseek_v3 import DeepseekMTPHead

        cfg = deepseek_config(tiny, fp8)
        with torch.device(device):
            head = DeepseekMTPHead(cfg, shard)
        _init_deepseek_head(head, seed=1)
        head.eval().prepare(dtype, kernels=device.type == "cuda")
        head.spec = deepseek_model_spec(cfg)
        return head, head.spec
    finally:
        torch.set_default_dtype(previous)


@dataclass(frozen=True)
class Plan:
    """One rank's orders (picklable: it crosses the spawn)."""

    rank: int
    world: int
    port: int
    device: str
    heads: tuple[str, ...]
    batches: tuple[int, ...]
    ks: tuple[int, ...]
    contexts: tuple[int, ...]
    iters: int
    eager: bool
    deepseek_fp8: bool
    out: str = ""  # rank 0 appends each row to out/rows.jsonl as it is measured
    bandwidth: float | None = None  # copy bytes per second (the floors), measured by the parent
    baseline: tuple = ()  # ((head, k, ctx, batch), propose_us) of the N = 1 run: speedups
    dump_stacks_after_s: float = 0.0  # > 0: each rank prints its threads' stacks after this long (faulthandler)
    rank_timeout_s: float = 0.0  # > 0: the ranks not done by then are killed and the run fails


def rank_device(base: str, rank: int) -> str:
    """Rank r's device, as serve places ranks (cuda:i -> cuda:i+r; cpu stays cpu)."""
    from drafter.service.tp.leader import rank_device as serve_rank_device

    return serve_rank_device(base, rank)


def _engine(head, spec, k: int, plan: Plan, device: torch.device, dtype: torch.dtype):
    """A DraftEngine over the rank's head sized for the plan's grid, random KV, graphs captured (N = 1, GPU)."""
    from drafter.engine.engine import DraftEngine

    max_batch, max_ctx = max(plan.batches), max(plan.contexts)
    per_req = -(-(max_ctx + k + 1) // BLOCK_SIZE)
    cfg = EngineConfig(
        method=spec.method, num_speculative_tokens=k, max_model_len=max_ctx + 64, max_num_seqs=max_batch,
        max_num_batched_tokens=max_batch * (k + 1), kv_groups=(KVGroupSpec(BLOCK_SIZE, max_batch * per_req + 1),),
        capture_sizes=plan.batches, token_capture_sizes=tuple(b * (k + 1) for b in plan.batches),
        device=str(device), dtype=str(dtype).removeprefix("torch."), use_cuda_graphs=device.type == "cuda",
        skinny_gemm="off")
    engine = DraftEngine(head, spec, cfg)
    random_kv(engine)
    if engine.graphs is not None:
        with torch.inference_mode():
            engine.graphs.capture()
    return engine


def _timer(device: torch.device):
    """Median microseconds of fn over iters calls (CUDA events on a GPU, the host clock on CPU)."""
    def median_us(fn, iters: int) -> float:
        fn()  # warm
        torch.distributed.barrier()
        if device.type == "cuda":
            from drafter.tools.bench.grid import time_events

            return statistics.median(time_events(fn, iters, warmup=1))
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(out)
    return median_us


def _bcast_us(call: dict, device: torch.device, timer, iters: int) -> float:
    """One broadcast of the call's tensors, packed as serve's leader packs a step (drafter.service.tp.channel)."""
    from drafter.service.tp.channel import comm_device, pack

    tensors = [t for v in call.values() for t in (v if isinstance(v, list) else [v])]
    _, buf = pack(tensors, comm_device(device))
    return timer(lambda: torch.distributed.broadcast(buf, src=0), iters)


def _rows_for_head(name: str, plan: Plan, shard: Shard, device: torch.device, dtype, timer) -> list[dict]:
    from drafter.tools.bench.grid import decode_call, on_device

    head, spec = build_head(name, shard, device, dtype, plan.deepseek_fp8)
    weight_bytes = sum(t.numel() * t.element_size() for t in list(head.parameters()) + list(head.buffers()))
    rows = []
    for k in plan.ks:
        engine = _engine(head, spec, k, plan, device, dtype)
        for ctx in plan.contexts:
            for b in plan.batches:
                call = on_device(decode_call(b, k, ctx, engine.config.kv_groups[0].num_blocks, spec.vocab_size,
                                             spec.hidden_input_width, dtype, seed=b * 7 + ctx), device)
                row = dict(head=name, k=k, ctx=ctx, batch=b, world=plan.world, rank=plan.rank,
                           graphs=engine.graphs is not None, weight_bytes=weight_bytes)
                with torch.inference_mode():
                    step = lambda: engine.propose(**call, validate=False)  # noqa: E731
                    row["propose_us"] = timer(step, plan.iters)
                    if plan.eager:
                        graphs, engine.graphs = engine.graphs, None
                        try:
                            row["eager_us"] = timer(step, max(3, plan.iters // 2))
                        finally:
                            engine.graphs = graphs
                    row["drafts"] = step().draft_token_ids.cpu().tolist()
                row["bcast_us"] = _bcast_us(call, device, timer, plan.iters)
                if plan.world > 1:
                    row["nccl_us"] = _collectives_us(_collectives_of(engine, call), shard, device, timer,
                                                     plan.iters)
                row["floor_bytes"] = propose_bytes(head, engine, k, b, ctx)
                if device.type == "cuda":
                    row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
                rows.append(row)
                _publish(row, plan)
        del engine
    del head
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _collectives_of(engine, call: dict) -> list:
    """(kind, shape, dtype) of every collective one eager step issues, in order (every rank runs it)."""
    calls = []
    graphs, engine.graphs = engine.graphs, None
    try:
        with torch.inference_mode(), recording(calls):
            engine.propose(**call, validate=False)
    finally:
        engine.graphs = graphs
    return calls


def _collectives_us(calls: list, shard: Shard, device: torch.device, timer, iters: int) -> float:
    """The step's collectives alone (preallocated tensors of the recorded shapes), timed: one CUDA
    graph of them on a GPU, as the step's graph issues them; eagerly on the host."""
    tensors = [torch.zeros(shape, dtype=dtype, device=device) for _, shape, dtype in calls]

    def issue() -> None:
        for (kind, _, _), t in zip(calls, tensors):
            if kind == "all_reduce":
                torch.distributed.all_reduce(t)
            else:
                shard.all_gather_rows(t)
    if device.type != "cuda":
        return timer(issue, iters)
    with torch.inference_mode():
        issue()  # eager first: buffers and communicator ready
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            issue()
    return timer(graph.replay, iters)


def propose_bytes(head, engine, k: int, batch: int, ctx: int) -> int:
    """What one rank reads for one propose call of `batch` requests at context ctx (see the module
    doc's floor_bytes): k forward passes, the first over batch * (k + 1) tokens, the others over batch."""
    from drafter.models.moe import MoE

    dense = fc = routed = embed_row = 0
    for name, t in list(head.named_parameters()) + list(head.named_buffers()):
        nbytes = t.numel() * t.element_size()
        if "embed_tokens" in name:
            embed_row = nbytes // t.shape[0]
        elif ".experts." in name:
            routed += nbytes
        elif name.startswith("fc."):
            fc += nbytes
        elif "kv_b_proj" not in name:  # MLA decodes through the absorbed w_uk / w_uv buffers
            dense += nbytes
    moe = next((m for m in head.modules() if isinstance(m, MoE)), None)
    kv_token = sum(_bytes_per_cached_token(c) for c in engine.kv.layers)
    total = fc
    for tokens in [batch * (k + 1)] + [batch] * (k - 1):
        total += dense + tokens * embed_row + batch * ctx * kv_token
        if moe is not None and routed:
            local = len(moe.experts)
            hit = local * (1 - (1 - moe.shape.top_k / moe.shape.num_experts) ** tokens)
            total += math.ceil(hit) * routed // local
    return total


def _bytes_per_cached_token(cache: torch.Tensor) -> int:
    """A layer's cache bytes per token: [2, blocks, block_size, kv_heads, head_dim] (GQA K and V)
    or [blocks, block_size, kv_lora + rope] (MLA's latent)."""
    tokens = cache.shape[1] * cache.shape[2] if cache.dim() == 5 else cache.shape[0] * cache.shape[1]
    return cache.numel() * cache.element_size() // tokens


def _publish(row: dict, plan: Plan) -> None:
    """Every rank's copy of the row to rank 0, which appends the merged row to out/rows.jsonl and prints it."""
    rows = [None] * plan.world
    torch.distributed.all_gather_object(rows, dict(row))
    if plan.rank != 0:
        return
    merged = finish_row(merge([[r] for r in rows])[0], plan.bandwidth, dict(plan.baseline))
    if plan.out:
        with open(Path(plan.out, "rows.jsonl"), "a") as f:
            f.write(json.dumps(merged) + "\n")
    print(fmt_row(merged), flush=True)


def finish_row(r: dict, bandwidth: float | None, baseline: dict) -> dict:
    """The floors (with a copy bandwidth) and the speedup over the N = 1 row (when there is one)."""
    if bandwidth:
        r["floor_weights_us"] = r["weight_bytes"] * 1e6 / bandwidth
        r["floor_us"] = r["floor_bytes"] * 1e6 / bandwidth
        r["step_over_floor"] = r["propose_us"] / r["floor_us"]
    one = baseline.get((r["head"], r["k"], r["ctx"], r["batch"]))
    if one is not None and r["world"] > 1:
        r["speedup"] = one / r["propose_us"]
    return r


def rank_main(plan: Plan, pipe) -> None:
    """One rank: join the group, run every head's rows in lockstep with the others, send them back."""
    from drafter.service.tp.worker import join_group, leave_group, loopback_collectives

    loopback_collectives()
    if plan.dump_stacks_after_s > 0:  # a stuck rank says where (stderr), then its parent's timeout kills it
        import faulthandler

        faulthandler.dump_traceback_later(plan.dump_stacks_after_s, exit=False)
    device = torch.device(rank_device(plan.device, plan.rank))
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.world))
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        join_group(plan.rank, plan.world, "127.0.0.1", plan.port, backend, 600.0, str(device))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        timer = _timer(device)
        rows = []
        for name in plan.heads:
            rows += _rows_for_head(name, plan, Shard(plan.rank, plan.world), device, dtype, timer)
        pipe.send(("rows", rows))
    except BaseException as exc:  # noqa: BLE001 - said by the parent, which fails the run
        import traceback

        pipe.send(("failed", f"rank {plan.rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    leave_group(device)  # on a GPU: exits here (destroying a group whose collectives graphs hold hangs)


def merge(per_rank: list[list[dict]]) -> list[dict]:
    """One row per (head, k, ctx, batch): rank 0's times, the slowest rank's, whether drafts agreed."""
    out = []
    for rows in zip(*per_rank):
        first = dict(rows[0])
        drafts = [r.pop("drafts") for r in rows]
        first.pop("drafts", None)
        first.pop("rank")
        first["propose_max_us"] = max(r["propose_us"] for r in rows)
        first["weight_bytes"] = max(r["weight_bytes"] for r in rows)
        if "floor_bytes" in first:
            first["floor_bytes"] = max(r["floor_bytes"] for r in rows)
        if "peak_bytes" in first:
            first["peak_bytes"] = max(r["peak_bytes"] for r in rows)
        first["drafts_agree"] = all(d == drafts[0] for d in drafts)
        out.append(first)
    return out


def spawn_ranks(plan: Plan) -> list[list[dict]]:
    """Run plan on plan.world spawned ranks; each rank's rows, in rank order.  The first rank to fail
    (or plan.rank_timeout_s passing) fails the run at once and kills every rank: a rank left behind
    would wait in a collective for its peer until the process group's timeout."""
    from drafter.service.tp.worker import loopback_collectives, loopback_store

    loopback_collectives()
    store, listening = loopback_store(plan.world, 600.0)
    ctx = multiprocessing.get_context("spawn")
    procs, pipes = [], []
    for rank in range(plan.world):
        mine, theirs = ctx.Pipe(duplex=False)
        p = ctx.Process(target=rank_main, args=(replace(plan, rank=rank, port=store.port), theirs),
                        name=f"bench-tp-{rank}")
        p.start()
        theirs.close()
        procs.append(p)
        pipes.append(mine)
    done = False
    try:
        results = _collect(plan, pipes, procs)
        done = True
    finally:
        for p in procs:
            p.join(60 if done else 0)
            if p.is_alive():
                p.kill()
                p.join(10)
        listening.close()
    return results


def _collect(plan: Plan, pipes: list, procs: list) -> list[list[dict]]:
    """Each rank's rows as they arrive, in rank order; SystemExit naming the first failure or timeout."""
    say = f"drafter bench --tensor-parallel-size {plan.world}"
    deadline = time.monotonic() + plan.rank_timeout_s if plan.rank_timeout_s > 0 else None
    waiting = {pipe: rank for rank, pipe in enumerate(pipes)}
    results: dict[int, list[dict]] = {}
    while waiting:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait(list(waiting), left)
        if not ready:
            raise SystemExit(f"{say}: ranks {sorted(waiting.values())} not done within {plan.rank_timeout_s} s "
                             "(killed; with --dump-stacks-after their stacks are on stderr)")
        for pipe in ready:
            rank = waiting.pop(pipe)
            try:
                kind, payload = pipe.recv()
            except EOFError:
                procs[rank].join(5)
                kind, payload = "failed", f"rank {rank} exited with code {procs[rank].exitcode}"
            if kind != "rows":
                raise SystemExit(f"{say}: {payload}")
            results[rank] = payload
    return [results[r] for r in range(len(pipes))]


def _copy_bandwidth(device: str) -> float | None:
    """Device-to-device copy bytes per second on the first GPU (None on CPU): the floors' bandwidth."""
    if not device.startswith("cuda"):
        return None
    from drafter.tools.bench.grid import copy_bandwidth

    return copy_bandwidth(torch.device(device), nbytes=1 << 30)


def run(args) -> dict:
    worlds = args.tensor_parallel_size if isinstance(args.tensor_parallel_size, list) else [args.tensor_parallel_size]
    heads = tuple(h for h in args.heads.split(",") if h)
    unknown = [h for h in heads if h not in HEADS]
    if unknown:
        raise SystemExit(f"drafter bench --tensor-parallel-size: unknown heads {unknown}; choose from {HEADS}")
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit(f"drafter bench --tensor-parallel-size: this torch ({torch.__version__}) sees no GPU; "
                             "--device cpu runs the ranks on the host (gloo)")
        base = int(args.device.partition(":")[2] or 0)
        if base + max(worlds) > torch.cuda.device_count():
            raise SystemExit(f"drafter bench --tensor-parallel-size {max(worlds)}: needs {max(worlds)} GPUs from "
                             f"{args.device}, {torch.cuda.device_count()} visible")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = _copy_bandwidth(args.device)
    rows: list[dict] = []
    for head in heads:  # every N for one head before the next: a run cut short keeps whole comparisons
        for world in worlds:
            baseline = tuple(((r["head"], r["k"], r["ctx"], r["batch"]), r["propose_us"]) for r in rows
                             if r["world"] == 1)
            plan = Plan(0, world, 0, args.device, (head,), tuple(args.batches), tuple(args.ks),
                        tuple(args.contexts), args.iters, not args.no_eager, args.deepseek_weights == "fp8",
                        str(out), bw, baseline, getattr(args, "dump_stacks_after", 0.0),
                        getattr(args, "rank_timeout", 0.0))  # drafter bench's flags have neither
            rows += [finish_row(r, bw, dict(baseline)) for r in merge(spawn_ranks(plan))]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "drafter bench " + " ".join(sys.argv[1:]), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
            "tensor_parallel_size": worlds[0] if len(worlds) == 1 else worlds, "copy_bandwidth": bw,
            "deepseek_weights": args.deepseek_weights}
    result = {"meta": meta, "rows": rows}
    (out / "bench_tp.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "bench_tp.md").write_text(markdown_table(rows))
    print(f"wrote {out / 'bench_tp.json'}, bench_tp.md ({len(rows)} rows)")
    return result


def markdown_table(rows: list[dict]) -> str:
    """One line per row: the step time, its speedup over N = 1, NCCL time and floor (a README's table)."""
    def cell(r: dict, key: str, spec: str) -> str:
        return format(r[key], spec) if key in r else "-"
    lines = ["| head | k | ctx | batch | N | propose us | speedup | nccl us | floor us | step / floor | graphs | agree |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['head']} | {r['k']} | {r['ctx']} | {r['batch']} | {r['world']} | {r['propose_us']:.0f} | "
                     f"{cell(r, 'speedup', '.2f')} | {cell(r, 'nccl_us', '.0f')} | {cell(r, 'floor_us', '.0f')} | "
                     f"{cell(r, 'step_over_floor', '.2f')} | {r['graphs']} | {r['drafts_agree']} |")
    return "\n".join(lines) + "\n"


def run_from_grid(args) -> dict:
    """`drafter bench --tensor-parallel-size N`: grid's flags, this module's heads unless --heads names them."""
    if args.weights != "bf16":
        raise SystemExit("drafter bench --tensor-parallel-size: --weights fp8 (per-channel FP8) runs on the "
                         "single-process path only; the DeepSeek head keeps its released FP8 blocks")
    heads = args.heads if all(h in HEADS for h in args.heads.split(",") if h) else DEFAULT_HEADS
    return run(argparse.Namespace(**{**vars(args), "heads": heads, "deepseek_weights": "fp8"}))


def fmt_row(r: dict) -> str:
    def opt(key: str, spec: str, scale: float = 1.0, unit: str = "") -> str:
        return f"{r[key] * scale:{spec}}{unit}" if key in r else "-"
    return (f"{r['head']:16s} tp={r['world']} k={r['k']} ctx={r['ctx']:5d} b={r['batch']:3d}  "
            f"propose {r['propose_us']:9.0f} us (max rank {r['propose_max_us']:9.0f})  x{opt('speedup', '.2f')}  "
            f"nccl {opt('nccl_us', '.0f')}  floor {opt('floor_us', '.0f')} ({opt('step_over_floor', '.2f')}x)  "
            f"eager {opt('eager_us', '.0f')}  bcast {r['bcast_us']:.0f}  weights {r['weight_bytes'] / 2**30:.2f}G  "
            f"peak {opt('peak_bytes', '.1f', 2**-30, 'G')}  graphs {r['graphs']}  agree {r['drafts_agree']}")


def add_arguments(p: argparse.ArgumentParser, *, with_size: bool = True) -> None:
    if with_size:
        p.add_argument("--tensor-parallel-size", type=_ints, default=[1],
                       help="ranks to split the head over; a list (1,2) runs each in turn [1]")
    p.add_argument("--out", default="bench/results/latest-tp", help="folder for bench_tp.json")
    p.add_argument("--heads", default=DEFAULT_HEADS, help=f"comma-separated, from {HEADS} [{DEFAULT_HEADS}]")
    p.add_argument("--batches", type=_ints, default=[1, 2, 4, 8, 16, 32, 64], help="batch sizes [1,2,...,64]")
    p.add_argument("--ks", type=_ints, default=[1, 3], help="draft lengths k [1,3]")
    p.add_argument("--contexts", type=_ints, default=[1024], help="context lengths [1024]")
    p.add_argument("--iters", type=int, default=20, help="timed repetitions per measurement [20]")
    p.add_argument("--no-eager", action="store_true", help="skip the graphs-off timings")
    p.add_argument("--rank-timeout", type=float, default=0.0,
                   help="seconds: ranks of one size not done by then are killed and the run fails [0: none]")
    p.add_argument("--dump-stacks-after", type=float, default=0.0,
                   help="seconds: each rank prints its stacks to stderr after this long (faulthandler) [0: never]")
    p.add_argument("--device", default="cuda", help="cuda (rank r on cuda:r) or cpu (gloo ranks) [cuda]")
    p.add_argument("--deepseek-weights", default="fp8", choices=("fp8", "bf16"),
                   help="deepseek heads: FP8 128x128 blocks as released, or dequantised bf16 [fp8]")


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="drafter bench --tensor-parallel-size", description=__doc__.split("\n")[0])
    add_arguments(p)
    p.add_argument("--table", metavar="ROWS_JSONL", help="only print the markdown table of a run's rows.jsonl "
                                                         "(one cut short included)")
    args = p.parse_args(argv)
    if args.table:
        print(markdown_table([json.loads(line) for line in Path(args.table).read_text().splitlines() if line]), end="")
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
