"""`drafter bench`: the engine's draft step on a GPU against the memory floor, eager vs graphs.

    python -m drafter.tools.bench.grid --out bench/results/run1        # or: drafter bench --out ...

Heads with the shapes of an EAGLE-3 for Llama-3.1-8B and of an 8B EAGLE-1, random bf16 weights
built on the GPU (no checkpoint is written).  For each head, k, context length and batch size
it times a steady-state propose call (every request verified k+1 tokens, all accepted):

  propose_us   the trusted in-process call, engine.propose(..., validate=False) with GPU
               inputs (load + first pass + draft loop + drafts into a fresh tensor), device
               time from the call's start to its end, eager and with graphs
  first_us     the first-pass graph alone, replays back to back
  loop_us      the draft-loop graph alone (sampling of step 0 + k-1 decode steps)
  combined_us  the combined graph (first pass + loop, what a decode call replays), if captured
  host_us      host time of that whole public call, output included (it returns before the
               GPU is done): what a trusted in-process caller (vLLM's proposer) pays per step
  host_validate_us  the same with validate=True (the default; the service's path): host-side
               checks of GPU inputs, i.e. a device sync and a dozen small copies per call
  host_bound_us     host time of the same call bound (engine.bind once over buffers holding it,
               then bound.propose(num_tokens, batch) per call: drafter.engine.bound), the path for a
               caller with persistent input buffers
  host_python_us    a fixed piece of pure Python timed just before host_us (host_calibration):
               how fast this host ran Python at that moment, to tell a slow call from a slow host

and the floor: bytes of weights and KV each step must read / the device-to-device copy
bandwidth measured at the start of the same run (bytes read + written per second).
  first pass      fc + layer + KV of every request (lm_head is in the loop graph)
  decode step     layer + lm_head + KV (EAGLE-1 also its fc), plus the embedding rows
With --weights fp8 every head runs twice in one process, its bf16 weights and then the same
weights quantised to per-channel FP8 (EngineConfig.weights="fp8"; rows "<head> fp8"): the FP8 rows'
floors count FP8 bytes, and each FP8 row carries fp8/bf16 of propose_us and loop_us (a summary
table at batch 1, 16, 64).
Writes bench.json (every number, device, versions, date, command) and bench.png.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.wire.records import ProposeInputs
from drafter.models.heads import HEADS
from drafter.models.layers import LayerShape
from drafter.models.spec import ModelSpec

BLOCK_SIZE = 16


def llama8b_layer() -> LayerShape:
    return LayerShape(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                      rms_norm_eps=1e-5, rope_theta=500000.0)


SPECS = {
    # EAGLE-3 for Llama-3.1-8B: 3 aux states in, 2H-wide attention, own 32000-token lm_head
    "eagle3-8b": ModelSpec(method="eagle3", hidden_size=4096, num_layers=1, vocab_size=128256,
                           layer_shapes=(llama8b_layer(),), draft_vocab_size=32000, aux_layer_ids=(2, 16, 29),
                           norm_before_residual=True, target_hidden_size=4096),
    # EAGLE-1 for an 8B Llama: fc over [embed; hidden] every step, the target's 128256-token lm_head
    "eagle-8b": ModelSpec(method="eagle", hidden_size=4096, num_layers=1, vocab_size=128256,
                          layer_shapes=(llama8b_layer(),), draft_vocab_size=128256, fc_bias=True),
}


def random_head(spec: ModelSpec, device, dtype, seed: int = 0):
    """The head's modules with random weights, allocated straight on the device."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            head = HEADS[spec.method](spec)
    finally:
        torch.set_default_dtype(default)
    head = head.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)  # norms
            else:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
        for name, b in head.named_buffers():
            b.zero_()  # d2t: draft id i is target id i
    return head.eval()


# ---------------------------------------------------------------------- floor
def weight_bytes(head, spec: ModelSpec) -> dict[str, int]:
    """Bytes of each part's weights: parameters and buffers (an FP8 head's payloads and scales).
    bytes_per_weight: 1 for an FP8 head (--weights fp8), else 2 (bf16)."""
    def nbytes(module):
        tensors = list(module.parameters()) + list(module.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    layer = sum(nbytes(m) for m in head.layers)
    if spec.method == "eagle3":
        layer -= nbytes(head.layers[0].input_layernorm) + nbytes(head.layers[0].hidden_norm)  # 2 x 8 KB, noise
    per_weight = 1 if getattr(head, "fp8_weights", False) else 2
    return {"layer": layer, "fc": nbytes(head.fc), "lm_head": nbytes(head.lm_head), "bytes_per_weight": per_weight}


def floors(w: dict[str, int], spec: ModelSpec, batch: int, ctx: int, k: int, bw: float) -> dict[str, float]:
    """Microseconds each part must take at copy bandwidth bw (bytes/s)."""
    shape = spec.layer_shapes[0]
    kv = batch * ctx * 2 * shape.num_kv_heads * shape.head_dim * 2 * spec.num_layers
    embed = batch * spec.hidden_size * 2
    fc_each_step = spec.method == "eagle"
    first = w["fc"] + w["layer"] + kv + embed * (k + 1)
    step = w["layer"] + w["lm_head"] + kv + embed + (w["fc"] if fc_each_step else 0)
    loop = w["lm_head"] + (k - 1) * step
    us = 1e6 / bw
    return {"first_us": first * us, "step_us": step * us, "loop_us": loop * us, "propose_us": (first + loop) * us,
            "kv_bytes_per_step": kv, "weight_bytes_per_step": step - kv - embed}


def matmul_peak(device, n: int = 8192, iters: int = 10) -> float:
    """bf16 tensor-core FLOP/s of an n^3 product on random data (median)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = time_events(lambda: a @ b, iters=iters, warmup=3)
    return 2 * n ** 3 / (statistics.median(times) * 1e-6)


def compute_floors(w: dict[str, int], spec: ModelSpec, batch: int, ctx: int, k: int, peak: float) -> dict:
    """Microseconds the matrix work alone must take at `peak` FLOP/s (2 FLOP per weight per row,
    plus q.k and p.v over the context); at large batch this, not memory, bounds the first pass."""
    shape = spec.layer_shapes[0]
    params = {key: v / w.get("bytes_per_weight", 2) for key, v in w.items()}  # bf16 or fp8 payloads
    attn = 4 * ctx * shape.num_heads * shape.head_dim
    tokens = batch * (k + 1)
    first = 2 * (params["fc"] + params["layer"]) * tokens + attn * tokens
    step = 2 * (params["layer"] + params["lm_head"] + (params["fc"] if spec.method == "eagle" else 0)) * batch \
        + attn * batch
    loop = 2 * params["lm_head"] * batch + (k - 1) * step
    us = 1e6 / peak
    return {"first_us": first * us, "loop_us": loop * us}


def copy_bandwidth(device, nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (median of iters)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    times = time_events(lambda: dst.copy_(src), iters=iters, warmup=3)
    return 2 * nbytes / (statistics.median(times) * 1e-6)


# ---------------------------------------------------------------------- timing
def time_events(fn, iters: int, warmup: int = 2, sync_each: bool = True) -> list[float]:
    """Device microseconds of fn per call, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if sync_each:
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3)
        else:
            out.append((start, end))
    if not sync_each:
        torch.cuda.synchronize()
        out = [s.elapsed_time(e) * 1e3 for s, e in out]
    return out


def host_calibration(calls: int = 200) -> float:
    """Median microseconds of a fixed pure-Python workload (about the size of a propose call's
    Python): the same number on a quiet host every time, so a host_us that rises with it is the
    host's moment, not the call."""
    def work():
        total = 0
        for i in range(300):
            total += i & 7
        return total
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        work()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def time_host(fn, iters: int, warmup: int = 2) -> list[float]:
    """Host microseconds until fn returns (the GPU is idle at each start)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return out


# ---------------------------------------------------------------------- inputs
def steady_state_call(engine, batch: int, ctx: int, seed: int) -> dict:
    """A decode-step propose call for this engine (see decode_call)."""
    spec, cfg = engine.spec, engine.config
    return decode_call(batch, cfg.num_speculative_tokens, ctx, cfg.kv_groups[0].num_blocks, spec.vocab_size,
                       spec.hidden_input_width, cfg.torch_dtype, seed)


def decode_call(batch: int, k: int, ctx: int, num_blocks: int, vocab: int, width: int, dtype, seed: int) -> dict:
    """A decode-step propose call: each request verified k+1 tokens ending at position ctx - 1
    (all accepted), on random distinct blocks of a pool of num_blocks; CPU tensors."""
    q = k + 1
    g = torch.Generator().manual_seed(seed)
    per_req = -(-(ctx + k + 1) // BLOCK_SIZE)
    blocks = torch.randperm(num_blocks, generator=g)[: batch * per_req].view(batch, per_req)
    positions = torch.arange(ctx - q, ctx).repeat(batch)
    owner = torch.arange(batch).repeat_interleave(q)
    slots = blocks[owner, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    return dict(
        target_token_ids=torch.randint(0, vocab, (batch * q,), generator=g),
        target_positions=positions,
        target_hidden_states=torch.randn(batch * q, width, generator=g).to(dtype),
        next_token_ids=torch.randint(0, vocab, (batch,), generator=g),
        query_start_loc=torch.arange(0, batch * q + 1, q, dtype=torch.int32),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32),
        block_tables=[blocks.to(torch.int32)],
        slot_mappings=[slots],
        num_rejected_tokens=torch.zeros(batch, dtype=torch.int32),
    )


def on_device(call: dict, device) -> dict:
    """A call's propose() keywords with every tensor on `device` (what an in-process caller passes)."""
    return {k: ([t.to(device) for t in v] if isinstance(v, list) else v.to(device)) for k, v in call.items()}


def as_inputs(call: dict, device=None) -> ProposeInputs:
    def mv(t):
        return t if device is None else t.to(device)
    return ProposeInputs(mv(call["target_token_ids"]), mv(call["target_positions"]), mv(call["target_hidden_states"]),
                         mv(call["next_token_ids"]), mv(call["query_start_loc"]), mv(call["seq_lens"]),
                         [mv(t) for t in call["block_tables"]], [mv(t) for t in call["slot_mappings"]],
                         None, mv(call["num_rejected_tokens"]))


def bind_call(engine, call: dict):
    """engine.bind over buffers holding exactly this call (drafter.engine.bound), its block tables
    widened to the engine's max_blocks_per_req as a target engine's persistent tables are."""
    tables = []
    for g, table in enumerate(call["block_tables"]):
        wide = torch.zeros(table.shape[0], engine.config.max_blocks_per_req[g], dtype=table.dtype, device=table.device)
        wide[:, :table.shape[1]] = table
        tables.append(wide)
    return engine.bind(**{**call, "block_tables": tables})


# ---------------------------------------------------------------------- one engine
def build_engine(head, spec, k: int, batches: list[int], max_ctx: int, device, skinny_gemm: str = "auto",
                 weights: str = "bf16"):
    from drafter.engine.engine import DraftEngine

    max_batch = max(batches)
    per_req = -(-(max_ctx + k + 1) // BLOCK_SIZE)
    cfg = EngineConfig(
        method=spec.method, num_speculative_tokens=k, max_model_len=max_ctx + 64, max_num_seqs=max_batch,
        max_num_batched_tokens=max_batch * (k + 1), kv_groups=(KVGroupSpec(BLOCK_SIZE, max_batch * per_req + 1),),
        capture_sizes=tuple(batches), token_capture_sizes=tuple(b * (k + 1) for b in batches),
        device=str(device), dtype="bfloat16", attention_backend="triton", use_cuda_graphs=True,
        skinny_gemm=skinny_gemm, weights=weights)
    engine = DraftEngine(head, spec, cfg)
    random_kv(engine)
    return engine


def random_kv(engine) -> None:
    """Fill every KV layer from a seeded normal: never time attention on zeros."""
    g = torch.Generator(device=engine.kv.layers[0].device).manual_seed(1)
    for cache in engine.kv.layers:
        cache.normal_(generator=g)


def bench_engine(engine, head_name: str, spec, wbytes, k: int, batches, contexts, bw: float, peak: float,
                 iters: int, eager: bool, log, peer=None) -> list[dict]:
    """peer: a drafter.tools.bench.peer.CompiledPeer of this engine, timed on every row, or None."""
    rows = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        engine.graphs.capture()
    log(f"  captured {len(engine.graphs.graphs)} graphs in {time.perf_counter() - t0:.1f}s")
    runner = engine.graphs
    for ctx in contexts:
        for b in batches:
            call = on_device(steady_state_call(engine, b, ctx, seed=b * 7 + ctx), engine.device)
            t_pad = b * (k + 1)
            row = dict(head=head_name, k=k, ctx=ctx, batch=b)
            with torch.inference_mode():
                engine.propose(**call)  # validates the call once
                graph_call = lambda: engine.propose(**call, validate=False)  # noqa: E731
                row["propose_us"] = statistics.median(time_events(graph_call, iters))
                row["first_us"] = statistics.median(time_events(runner.first_graphs[t_pad], iters, sync_each=False))
                row["loop_us"] = statistics.median(time_events(runner.loop_graphs[b], iters, sync_each=False))
                combined = runner.combined_graphs.get((t_pad, b))
                if combined is not None:
                    row["combined_us"] = statistics.median(time_events(combined, iters, sync_each=False))
                row["host_python_us"] = host_calibration()
                host = sorted(time_host(graph_call, 5 * iters))
                row["host_us"] = statistics.median(host)
                row["host_p10_us"] = host[len(host) // 10]  # this host's quieter moments
                row["host_validate_us"] = statistics.median(time_host(lambda: engine.propose(**call), iters))
                bound, n = bind_call(engine, call), call["target_token_ids"].shape[0]
                row["bound_drafts_equal"] = bool(torch.equal(bound.propose(n, b)[:b], graph_call().draft_token_ids))
                row["host_bound_us"] = statistics.median(time_host(lambda: bound.propose(n, b), 5 * iters))
                if eager:
                    graphs, engine.graphs = engine.graphs, None
                    try:
                        row["eager_propose_us"] = statistics.median(time_events(graph_call, max(3, iters // 2)))
                    finally:
                        engine.graphs = graphs
                if peer is not None:
                    from drafter.tools.bench.peer import peer_row

                    row.update(peer_row(peer, call, graph_call().draft_token_ids, iters))
            f = floors(wbytes, spec, b, ctx, k, bw)
            row.update({f"floor_{key}": v for key, v in f.items()})
            row["ratio_propose"] = row["propose_us"] / f["propose_us"]
            row["ratio_device"] = (row["first_us"] + row["loop_us"]) / f["propose_us"]
            row["ratio_first"] = row["first_us"] / f["first_us"]
            c = compute_floors(wbytes, spec, b, ctx, k, peak)
            # roofline: each phase bounded by the larger of its memory and its matrix-unit time
            row["floor_roofline_us"] = max(f["first_us"], c["first_us"]) + max(f["loop_us"], c["loop_us"])
            row["ratio_roofline"] = (row["first_us"] + row["loop_us"]) / row["floor_roofline_us"]
            if k > 1:
                # one decode step: the loop graph minus its step-0 sampling, over k-1 steps
                row["ratio_loop"] = row["loop_us"] / f["loop_us"]
            if "peer_us" in row:
                # the engine's whole public call against the peer's replay alone (no host work),
                # and replay against replay (the combined graph, else first pass + loop)
                row["ratio_peer"] = row["propose_us"] / row["peer_us"]
                replay_us = row.get("combined_us", row["first_us"] + row["loop_us"])
                row["ratio_peer_graph"] = replay_us / row["peer_replay_us"]
                row["ratio_peer_floor"] = row["peer_us"] / f["propose_us"]
            rows.append(row)
            log(fmt_row(row))
    return rows


def fmt_row(r: dict) -> str:
    eager = f"{r['eager_propose_us']:9.0f}" if "eager_propose_us" in r else f"{'-':>9}"
    loop = f"{r['ratio_loop']:5.2f}" if "ratio_loop" in r else f"{'-':>5}"
    combined = f"{r['combined_us']:7.0f}" if "combined_us" in r else f"{'-':>7}"
    return (f"{r['head']:10} k={r['k']} ctx={r['ctx']:5} b={r['batch']:3} | propose graph {r['propose_us']:8.0f} us"
            f" eager {eager} us | first {r['first_us']:7.0f} loop {r['loop_us']:7.0f} combined {combined}"
            f" | floor {r['floor_propose_us']:7.0f}"
            f" | ratio propose {r['ratio_propose']:5.2f} device {r['ratio_device']:5.2f} loop {loop}"
            f" roofline {r['ratio_roofline']:5.2f}"
            + (f" | peer {r['peer_us']:7.0f} us (replays {r['peer_replay_us']:7.0f}, drafts agree"
               f" {r['peer_drafts_agree']:.2f}) engine/peer {r['ratio_peer']:5.2f} graph/graph"
               f" {r['ratio_peer_graph']:5.2f} peer/floor {r['ratio_peer_floor']:5.2f}" if "peer_us" in r else "")
            + f" | host {r['host_us']:5.0f} us (p10 {r.get('host_p10_us', float('nan')):4.0f},"
            f" python {r.get('host_python_us', float('nan')):4.1f}, validated"
            f" {r['host_validate_us']:5.0f}, bound {r.get('host_bound_us', float('nan')):5.0f})")


# ---------------------------------------------------------------------- host time
def host_breakdown(engine, call: dict, iters: int = 50) -> dict:
    """Host microseconds (median) of a trusted graph-replayed propose, engine.propose(...,
    validate=False) with GPU inputs, and of each part of it, and the top of a cProfile of the
    whole call: where the host time goes.  rest_us is what the parts leave unexplained
    (keyword parsing, the path's branches, attribute lookups)."""
    import cProfile
    import io
    import pstats

    from drafter.wire.records import DraftOutput
    from drafter.engine.graphs import on_device as inputs_on_device
    from drafter.engine.inputs import as_group_list

    runner = engine.graphs
    kw = on_device(call, engine.device)
    inp = as_inputs(call, engine.device)
    b_pad, t_pad = engine._padded_sizes(inp, None, None)
    out = runner.new_output(inp.batch_size)
    combined = runner.combined_graphs.get((t_pad, b_pad))
    groups = len(engine.config.kv_groups)

    def build_inputs():
        return ProposeInputs(kw["target_token_ids"], kw["target_positions"], kw["target_hidden_states"],
                             kw["next_token_ids"], kw["query_start_loc"], kw["seq_lens"],
                             as_group_list("block_tables", kw["block_tables"], groups),
                             as_group_list("slot_mappings", kw["slot_mappings"], groups),
                             None, kw["num_rejected_tokens"], None)

    def med(fn):
        return statistics.median(time_host(fn, iters))

    out_us = {}
    with torch.inference_mode():
        whole = lambda: engine.propose(**kw, validate=False)  # noqa: E731
        out_us["propose_us"] = med(whole)
        parts = {
            "propose_inputs_us": build_inputs,
            "padded_sizes_us": lambda: engine._padded_sizes(inp, None, None),
            "on_device_us": lambda: inputs_on_device(inp, runner.device),
            "output_alloc_us": lambda: runner.new_output(inp.batch_size),
            "header_us": lambda: runner.header.write(inp, out),
            "replay_us": combined if combined is not None else (
                lambda: (runner.first_graphs[t_pad](), runner.loop_graphs[b_pad]())),
            "loaded_us": runner.header.loaded,
            "draft_output_us": lambda: DraftOutput(out, None, b_pad, t_pad),
        }
        out_us.update({name: med(fn) for name, fn in parts.items()})
        out_us["rest_us"] = out_us["propose_us"] - sum(out_us[name] for name in parts)
        out_us["first_replay_us"] = med(runner.first_graphs[t_pad])
        out_us["loop_replay_us"] = med(runner.loop_graphs[b_pad])
        out_us["validated_propose_us"] = med(lambda: engine.propose(**kw))
        out_us["combined_graph"] = combined is not None
        prof = cProfile.Profile()
        for _ in range(200):
            torch.cuda.synchronize()  # outside the profile: the host part of each call alone
            prof.enable()
            whole()
            prof.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    out_us["cprofile_top"] = text.getvalue().splitlines()[-20:]
    return out_us


def decode_attention_case(device, ctx: int, batch: int, copies: int = 1):
    """Llama-8B decode attention inputs (32 query heads, 8 KV heads, head_dim 128, pages of 16),
    every request at `ctx` keys on random blocks: (KV caches (`copies` of them, so repeated runs
    need not hit L2), metadata, q [batch, 32, 128], bytes of KV one launch reads)."""
    from drafter.attention.metadata import AttentionMetadata

    per_req = -(-(ctx + 8) // BLOCK_SIZE)
    caches = [torch.randn(2, batch * per_req + 1, BLOCK_SIZE, 8, 128, device=device, dtype=torch.bfloat16)
              for _ in range(copies)]
    table = torch.randperm(batch * per_req, device=device).view(batch, per_req).int()
    meta = AttentionMetadata(torch.arange(batch + 1, device=device, dtype=torch.int32),
                             torch.full((batch,), ctx, device=device, dtype=torch.int32), table,
                             torch.full((batch,), -1, device=device, dtype=torch.long), BLOCK_SIZE)
    q = torch.randn(batch, 32, 128, device=device, dtype=torch.bfloat16)
    return caches, meta, q, batch * ctx * 2 * 8 * 128 * 2


def attention_sweep(device, contexts, batches, bw: float, log) -> list[dict]:
    """The decode attention kernel alone at several launch sizes: achieved KV bandwidth per
    target program count (bench/probe_attention.py times more shapes, in graphs)."""
    from drafter.attention.triton_backend import TritonBackend

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for ctx in contexts:
        for b in batches:
            per_req = -(-(ctx + 8) // BLOCK_SIZE)
            (cache,), meta, q, kv_bytes = decode_attention_case(device, ctx, b)
            for mult in (1, 2, 4, 8):
                backend = TritonBackend(target_programs=mult * sms)
                us = statistics.median(time_events(lambda: backend.attend(q, cache, meta, None), 20, sync_each=False))
                launch = backend._launch(q.device, b * 8)
                rows.append({"ctx": ctx, "batch": b, "programs_per_sm": mult, "us": us,
                             "splits": backend._splits(q.device, b * 8, per_req * BLOCK_SIZE, launch),
                             "fraction_of_copy_bw": kv_bytes / (us * 1e-6) / bw})
                log(f"  attention ctx={ctx} b={b} programs/SM={mult}: {us:7.1f} us, splits {rows[-1]['splits']},"
                    f" {rows[-1]['fraction_of_copy_bw']:.2f} of copy bandwidth")
    return rows


def gemm_sweep(device, bw: float, log) -> list[dict]:
    """The decode step's weight GEMMs alone (Llama-8B EAGLE-3 shapes), as the engine runs them
    (F.linear on [out, in] weights) and on pre-transposed [in, out] weights: bandwidth per layout."""
    import torch.nn.functional as F

    shapes = {"qkv": (6144, 8192), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (32000, 4096)}
    rows = []
    for name, (n_out, n_in) in shapes.items():
        ws = [torch.randn(n_out, n_in, device=device, dtype=torch.bfloat16) for _ in range(3)]  # rotate: no L2 reuse
        wts = [w.t().contiguous() for w in ws]
        for m in (1, 16, 64):
            x = torch.randn(m, n_in, device=device, dtype=torch.bfloat16)
            for layout, fn in (("linear", lambda i: F.linear(x, ws[i % 3])), ("transposed", lambda i: x @ wts[i % 3])):
                it = iter(range(10 ** 9))
                us = statistics.median(time_events(lambda: fn(next(it)), 30, sync_each=False))
                frac = n_out * n_in * 2 / (us * 1e-6) / bw
                rows.append({"gemm": name, "m": m, "layout": layout, "us": us, "fraction_of_copy_bw": frac})
        log(f"  gemm {name}: " + ", ".join(f"m={r['m']} {r['layout']} {r['us']:.1f}us ({r['fraction_of_copy_bw']:.2f})"
                                          for r in rows if r["gemm"] == name))
    return rows


def gemm_plans(head) -> dict[str, dict[int, str]]:
    """Which kernel and block sizes each fused weight GEMM took per row bucket (the start-up timing's choice)."""
    from drafter.kernels.weight_gemm import WeightGemm

    def name(c) -> str:
        return c if isinstance(c, str) else c.label

    def timings(plan_us: dict) -> dict:
        return {b: {name(c): us for c, us in t.items()} for b, t in plan_us.items() if b != "prescaled"}

    plans = {}
    for mod_name, mod in head.named_modules():
        for attr, gemm in vars(mod).items():
            if isinstance(gemm, WeightGemm):
                plans[f"{mod_name}.{attr}".lstrip(".")] = {
                    "picked": {b: name(c) for b, c in gemm.configs.items()}, "timings_us": timings(gemm.plan_us)}
                if "prescaled" in gemm.plan_us:  # the plan for inputs that carry x * norm weight
                    plans[f"{mod_name}.{attr} prescaled".lstrip(".")] = {
                        "picked": {b: name(c) for b, c in gemm.scaled_configs.items()},
                        "timings_us": timings(gemm.plan_us["prescaled"])}
    return plans


# ---------------------------------------------------------------------- profile
def kernel_profile(engine, call: dict, use_graphs: bool, reps: int = 3) -> list[dict]:
    """Device time per kernel name over `reps` calls (diagnostics: what the step spends on)."""
    from torch.profiler import ProfilerActivity, profile

    inp = as_inputs(call, engine.device)
    graphs = engine.graphs
    if not use_graphs:
        engine.graphs = None
    try:
        with torch.inference_mode():
            engine._propose_validated(inp, False, False, None, None)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    engine._propose_validated(inp, False, False, None, None)
                torch.cuda.synchronize()
    finally:
        engine.graphs = graphs
    out = []
    for e in prof.key_averages():
        total = getattr(e, "self_device_time_total", None)
        if total is None:
            total = getattr(e, "self_cuda_time_total", 0)
        if total > 0:
            out.append({"kernel": e.key[:120], "count": e.count // reps, "us_per_call": total / reps})
    return sorted(out, key=lambda r: -r["us_per_call"])


# ---------------------------------------------------------------------- plot
def plot(rows: list[dict], meta: dict, path: Path) -> None:
    """Per head: device time / floor of the whole propose and of its decode steps, and latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = sorted({r["head"] for r in rows})
    fig, axes = plt.subplots(3, len(heads), figsize=(7 * len(heads), 13), squeeze=False)
    for col, head in enumerate(heads):
        for row_i, (key, title) in enumerate((("ratio_device", "propose (first pass + loop graphs) / floor"),
                                              ("ratio_loop", "decode steps (loop graph) / floor"))):
            ax = axes[row_i][col]
            for r_ctx, style in zip(sorted({r["ctx"] for r in rows}), ("-", "--")):
                for k in sorted({r["k"] for r in rows}):
                    pts = sorted((r["batch"], r[key]) for r in rows
                                 if r["head"] == head and r["ctx"] == r_ctx and r["k"] == k and key in r)
                    if pts:
                        ax.plot(*zip(*pts), style, marker="o", label=f"ctx {r_ctx}, k={k}")
            ax.axhline(1.15, color="red", lw=0.8, ls=":")
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{head}: {title}")
            ax.set_xlabel("batch")
            ax.legend(fontsize=7)
        ax = axes[2][col]
        ctx = min(r["ctx"] for r in rows)
        for k in sorted({r["k"] for r in rows}):
            sel = sorted((r for r in rows if r["head"] == head and r["ctx"] == ctx and r["k"] == k),
                         key=lambda r: r["batch"])
            ax.plot([r["batch"] for r in sel], [r["propose_us"] for r in sel], "-o", label=f"graph k={k}")
            if all("eager_propose_us" in r for r in sel):
                ax.plot([r["batch"] for r in sel], [r["eager_propose_us"] for r in sel], ":x", label=f"eager k={k}")
            ax.plot([r["batch"] for r in sel], [r["floor_propose_us"] for r in sel], "--", lw=0.8,
                    label=f"floor k={k}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{head}: propose call latency (us), ctx {ctx}")
        ax.set_xlabel("batch")
        ax.legend(fontsize=7)
    fig.suptitle(f"{meta['device']}, {meta['date']}, copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------------- main
def register(subparsers) -> argparse.ArgumentParser:
    """`drafter bench` in the CLI (drafter.cli.SUBCOMMANDS)."""
    p = subparsers.add_parser("bench", help="engine microbenchmark on a GPU vs the memory floor")
    _arguments(p)
    p.set_defaults(func=lambda args: run(args) and 0)
    return p


add_bench_parser = register


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench/results/latest", help="folder for bench.json and bench.png "
                                                                 "[bench/results/latest]")
    p.add_argument("--heads", default="eagle3-8b,eagle-8b", help=f"comma-separated, from {sorted(SPECS)} "
                                                                  "[eagle3-8b,eagle-8b]")
    p.add_argument("--batches", type=_ints, default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                   help="batch sizes (requests per call), comma-separated [1,2,4,...,256]")
    p.add_argument("--ks", type=_ints, default=[1, 3, 5], help="draft lengths k, comma-separated [1,3,5]")
    p.add_argument("--contexts", type=_ints, default=[1024, 8192],
                   help="context lengths (tokens of KV each request reads), comma-separated [1024,8192]")
    p.add_argument("--iters", type=int, default=20, help="timed repetitions per measurement [20]")
    p.add_argument("--no-eager", action="store_true", help="skip the eager timings")
    p.add_argument("--profile", action="store_true", help="per-kernel device times for a few shapes")
    p.add_argument("--attention-sweep", action="store_true", help="time the decode attention kernel alone")
    p.add_argument("--gemm-sweep", action="store_true", help="time the step's weight GEMMs alone, two layouts")
    p.add_argument("--device", default="cuda", help="the CUDA device to time [cuda]")
    p.add_argument("--no-peer", action="store_true", help="skip the torch.compile'd peer (drafter.tools.bench.peer)")
    p.add_argument("--weights", default="bf16", choices=("bf16", "fp8"),
                   help="fp8: each head with bf16 weights and then per-channel FP8 ones (EngineConfig.weights), "
                        "fp8 / bf16 per row; the peer runs for the bf16 rows only")
    p.add_argument("--skinny-gemm", default="auto", choices=("auto", "on", "off"),
                   help="the step GEMMs: drafter's skinny kernel where faster (auto), always, or cuBLAS only")
    p.add_argument("--tensor-parallel-size", type=int, default=0,
                   help="N >= 1: time drafter.tools.bench.tp's heads (deepseek-v3-mtp, eagle3-70b) split over N "
                        "spawned ranks instead (--heads defaults to those; --batches, --ks, --contexts, --iters, "
                        "--no-eager, --device, --out apply)")
    p.add_argument("--replot", metavar="JSON", help="only redraw bench.png beside JSON from a bench.json (no GPU "
                                                    "needed), e.g. bench/results/2026-11-22-h100-skinny-gemm/bench.json")


NO_GPU = ("drafter bench times the engine on a CUDA GPU and this torch sees none ({torch}). Recorded runs are in "
          "bench/results/ (README.md there has the tables); `drafter bench --replot "
          "bench/results/2026-11-22-h100-skinny-gemm/bench.json` redraws a plot from one without a GPU.")


def _replot(src: Path) -> dict:
    """Redraw bench.png beside a bench.json and say where it went."""
    try:
        result = json.loads(src.read_text())
        rows, meta = result["rows"], result["meta"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"drafter bench --replot {src}: not a readable bench.json ({exc})") from None
    dst = src.with_name("bench.png")
    plot(rows, meta, dst)
    print(f"wrote {dst} ({len(rows)} rows of {meta.get('device', '?')}, {meta.get('date', '?')})")
    return result


def run(args) -> dict:
    if args.replot:
        return _replot(Path(args.replot))
    if getattr(args, "tensor_parallel_size", 0):
        from drafter.tools.bench.tp import run_from_grid

        return run_from_grid(args)
    if not torch.cuda.is_available():
        raise SystemExit(NO_GPU.format(torch=torch.__version__))
    import triton

    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    props = torch.cuda.get_device_properties(device)
    bw = copy_bandwidth(device)
    meta = {
        "device": props.name, "sms": props.multi_processor_count,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "drafter bench " + " ".join(sys.argv[1:]), "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(),
        "copy_bandwidth_GBps": bw / 1e9, "block_size": BLOCK_SIZE, "dtype": "bfloat16",
        "skinny_gemm": args.skinny_gemm, "weights": args.weights,
    }
    log(f"{meta['device']} ({meta['sms']} SMs), torch {meta['torch']}, triton {meta['triton']}: "
        f"device copy {bw / 1e9:.0f} GB/s (read + write)")
    peak = matmul_peak(device)
    meta["matmul_bf16_TFLOPs"] = peak / 1e12
    log(f"bf16 matrix product {peak / 1e12:.0f} TFLOP/s")
    rows, profiles, host = [], {}, {}
    sweep = attention_sweep(device, args.contexts, [1, 16, 64, 256], bw, log) if args.attention_sweep else []
    gemms = gemm_sweep(device, bw, log) if args.gemm_sweep else []
    weight_kinds = ("bf16", "fp8") if args.weights == "fp8" else ("bf16",)
    for head_name, weights in [(h, w) for h in args.heads.split(",") for w in weight_kinds]:
        spec = SPECS[head_name]
        head = random_head(spec, device, torch.bfloat16)  # the same seed: fp8 quantises the bf16 run's weights
        if weights == "fp8":
            from drafter.models.fp8 import quantize_head

            quantize_head(head)
        label = head_name if weights == "bf16" else f"{head_name} fp8"
        wbytes = weight_bytes(head, spec)
        log(f"{label}: weights per decode step {(wbytes['layer'] + wbytes['lm_head']) / 1e6:.0f} MB "
            f"(layer {wbytes['layer'] / 1e6:.0f}, lm_head {wbytes['lm_head'] / 1e6:.0f}, fc {wbytes['fc'] / 1e6:.0f})")
        for k in args.ks:
            t0 = time.perf_counter()
            engine = build_engine(head, spec, k, args.batches, max(args.contexts), device, args.skinny_gemm,
                                  weights)
            log(f" k={k}: engine built in {time.perf_counter() - t0:.1f}s")
            meta.setdefault("gemm_plans", {})[f"{label} k={k}"] = plans = gemm_plans(head)
            for name, plan in plans.items():
                log(f"  GEMM plan {name} (row bucket: picked; us of cuBLAS and of each"
                    " block_n/block_k/warps/stages[ swap][+tma]): "
                    + " | ".join(f"{b}: {plan['picked'].get(b, 'cublas')}; "
                                 + ", ".join(f"{c} {us:.1f}" for c, us in t.items())
                                 for b, t in plan["timings_us"].items()))
            from drafter.tools.bench.peer import make_peer

            peer = None if args.no_peer or weights == "fp8" else make_peer(head, spec, engine, log)
            rows += bench_engine(engine, label, spec, wbytes, k, args.batches, args.contexts, bw, peak,
                                 args.iters, not args.no_eager, log, peer)
            if peer is not None:
                peer.close()
                del peer
            if head_name == "eagle3-8b":
                for b in (1, 16, 64):
                    if b in args.batches:
                        hb = host_breakdown(engine, steady_state_call(engine, b, min(args.contexts), seed=3))
                        host[f"{label} k={k} b={b}"] = hb
                        log(f"  host {label} k={k} b={b}: " + ", ".join(
                            f"{key} {v:.1f}" for key, v in hb.items() if key.endswith("_us")))
                        if b == 16 and k == 3:
                            log("\n".join("    " + line for line in hb["cprofile_top"]))
            if args.profile and k == 3:
                for b in (1, 64):
                    if b in args.batches:
                        call = steady_state_call(engine, b, min(args.contexts), seed=5)
                        for mode in ("eager", "graph"):
                            prof = kernel_profile(engine, call, mode == "graph")
                            profiles[f"{label} k={k} b={b} ctx={min(args.contexts)} {mode}"] = prof
                            log(f"  profile {label} b={b} {mode}: " + "; ".join(
                                f"{p['kernel'][:48]} x{p['count']} {p['us_per_call']:.0f}us" for p in prof[:14]))
            # what is measured so far survives a timeout
            (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows, "profiles": profiles,
                                                        "host": host, "partial": True}, indent=1))
            del engine
            gc.collect()  # the graph runner and the engine reference each other
            torch.cuda.empty_cache()
        del head
        torch.cuda.empty_cache()
    fp8_table = fp8_comparison(rows) if args.weights == "fp8" else []
    result = {"meta": meta, "rows": rows, "profiles": profiles, "host": host, "attention_sweep": sweep,
              "gemm_sweep": gemms, "fp8_vs_bf16": fp8_table}
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    (out / "bench.log").write_text("\n".join(lines) + "\n")
    try:
        plot(rows, meta, out / "bench.png")
    except Exception as exc:  # the numbers matter more than the picture
        log(f"plot failed: {exc!r}")
    summary(rows, log)
    if fp8_table:
        log_fp8(fp8_table, log)
        (out / "bench.log").write_text("\n".join(lines) + "\n")
    return result


def fp8_comparison(rows: list[dict]) -> list[dict]:
    """Give every "<head> fp8" row its bf16 twin's times (same head, k, ctx, batch) and the ratios
    fp8 / bf16 of the whole propose call and of the draft loop; returns those rows' summaries."""
    bf16 = {(r["head"], r["k"], r["ctx"], r["batch"]): r for r in rows}
    table = []
    for r in rows:
        if not r["head"].endswith(" fp8"):
            continue
        twin = bf16.get((r["head"][:-len(" fp8")], r["k"], r["ctx"], r["batch"]))
        if twin is None:
            continue
        r["bf16_propose_us"], r["bf16_loop_us"] = twin["propose_us"], twin["loop_us"]
        r["ratio_bf16_propose"] = r["propose_us"] / twin["propose_us"]
        r["ratio_bf16_loop"] = r["loop_us"] / twin["loop_us"]
        table.append({key: r[key] for key in ("head", "k", "ctx", "batch", "propose_us", "bf16_propose_us",
                                              "ratio_bf16_propose", "loop_us", "bf16_loop_us", "ratio_bf16_loop",
                                              "floor_propose_us", "ratio_propose")}
                     | {"bf16_ratio_propose": twin["ratio_propose"]})
    return table


def log_fp8(table: list[dict], log) -> None:
    log("\nFP8 weights (per-channel e4m3) against bf16, graphs, same process (floors: each run's own weight bytes)")
    log(f"  {'head':14} {'k':>2} {'ctx':>5} {'b':>3} | propose us fp8 / bf16 = ratio | loop us fp8 / bf16 = ratio"
        " | propose/floor fp8, bf16")
    for t in table:
        log(f"  {t['head']:14} {t['k']:2} {t['ctx']:5} {t['batch']:3} | {t['propose_us']:8.0f} / "
            f"{t['bf16_propose_us']:8.0f} = {t['ratio_bf16_propose']:.3f} | {t['loop_us']:7.0f} / "
            f"{t['bf16_loop_us']:7.0f} = {t['ratio_bf16_loop']:.3f} | {t['ratio_propose']:.2f}, "
            f"{t['bf16_ratio_propose']:.2f}")


def summary(rows: list[dict], log) -> None:
    log("\nsummary (graphs): worst ratio to the floor at batch <= 64, per head / k / ctx")
    keys = sorted({(r["head"], r["k"], r["ctx"]) for r in rows})
    for head, k, ctx in keys:
        sel = [r for r in rows if (r["head"], r["k"], r["ctx"]) == (head, k, ctx) and r["batch"] <= 64]
        if not sel:
            continue
        worst = max(sel, key=lambda r: r["ratio_propose"])
        loop = max((r.get("ratio_loop", 0) for r in sel), default=0)
        faster = all(r.get("eager_propose_us", math.inf) > r["propose_us"] for r in sel)
        roof = max(r["ratio_roofline"] for r in sel)
        log(f"  {head:10} k={k} ctx={ctx:5}: propose/floor max {worst['ratio_propose']:.2f} (b={worst['batch']}),"
            f" loop/floor max {loop:.2f}, device/roofline max {roof:.2f},"
            f" graphs faster than eager at every b<=64: {faster},"
            f" host max {max(r['host_us'] for r in sel):.0f} us"
            f" (bound calls: {max(r.get('host_bound_us', math.nan) for r in sel):.0f} us)")
        peer = [r for r in sel if "ratio_peer" in r]
        if peer:
            worst = max(peer, key=lambda r: r["ratio_peer"])
            log(f"  {'':10} vs the compiled peer: engine/peer max {worst['ratio_peer']:.2f} (b={worst['batch']}),"
                f" graph/graph max {max(r['ratio_peer_graph'] for r in peer):.2f},"
                f" engine ahead at every b<=64: {all(r['ratio_peer'] < 1 for r in peer)},"
                f" drafts agree min {min(r['peer_drafts_agree'] for r in peer):.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="drafter bench", description=__doc__.split("\n")[0])
    _arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
