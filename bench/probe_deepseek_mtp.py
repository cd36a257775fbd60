"""Probe on a GPU host: one DeepSeek-V3 MTP draft step at the released shape, TP = 1.

    python bench/probe_deepseek_mtp.py --out DIR [--batches 1,2,4,8,16,32,64 --context 1024]

Builds the MTP layer of DeepSeek-V3 (hidden 7168, 128 MLA heads with ranks 1536 / 512, rope 64,
256 experts top-8 in 8 groups, 1 shared expert, expert intermediate 2048, vocabulary 129280)
with random weights directly on the GPU, FP8 128x128 blocks as released ("fp8") or dequantised
to bf16 ("bf16"), and times one decode step per batch size: every request has `context` tokens
in the paged compressed KV cache (pages of 16) and one new token; the step is the layer, the
shared head's logits and the argmax.  Eager and CUDA-graph replay times (CUDA events, 3 KV caches
rotated so nothing is served from L2), the weights' bytes, the KV cache's bytes per token, the
step's peak memory above the weights, and a bandwidth floor (the bytes a step must read at the
measured copy bandwidth: attention / eh_proj / head weights, the distinct experts the batch hit,
the KV it reads), and for the --breakdown batches each part of the step timed alone in a graph.
Writes DIR/probe_deepseek_mtp.json.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from drafter.attention.metadata import AttentionMetadata
from drafter.models.deepseek_config import DEEPSEEK_V3, parse_deepseek
from drafter.models.deepseek_v3 import DeepseekMTPHead, kv_cache_shape
from drafter.models.fp8 import FP8, FP8Linear
from drafter.models.moe import route

PAGE = 16
CACHES = 3


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write counted), 2 GiB."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * 10 * a.numel() / (start.elapsed_time(end) / 1e3)


@torch.no_grad()
def random_head(fp8: bool) -> DeepseekMTPHead:
    """The MTP head at the released shape, random weights of sane scale, built on the GPU."""
    cfg = parse_deepseek(DEEPSEEK_V3)
    if not fp8:
        cfg = replace(cfg, fp8_block=None)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            head = DeepseekMTPHead(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    for module in head.modules():
        if isinstance(module, FP8Linear):
            module.weight.copy_(torch.randn(module.weight.shape, device="cuda", dtype=torch.bfloat16).to(FP8))
            module.weight_scale_inv.fill_(module.in_features ** -0.5)
        elif isinstance(module, nn.Linear):
            module.weight.normal_(0, module.in_features ** -0.5)
    for name, p in head.named_parameters():
        if name.endswith("embed_tokens.weight"):
            p.normal_()
        elif "norm" in name:
            p.fill_(1.0)
        elif name.endswith("gate.weight"):
            p.normal_(0, p.shape[1] ** -0.5)
    for layer in head.layers:
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.01)
    head.eval().prepare(torch.bfloat16, kernels=True)
    return head


def weight_bytes(head: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(head.parameters()) + list(head.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def decode_case(head, batch: int, context: int):
    """Inputs and metadata of one decode step: `batch` requests, each at position `context`."""
    shape = head.config.layers[0]
    blocks_per_req = -(-(context + 1) // PAGE)
    caches = [torch.randn(kv_cache_shape(shape, batch * blocks_per_req, PAGE), device="cuda", dtype=torch.bfloat16)
              for _ in range(CACHES)]
    table = torch.arange(batch * blocks_per_req, device="cuda", dtype=torch.int32).view(batch, blocks_per_req)
    pos = torch.full((batch,), context, device="cuda", dtype=torch.long)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((batch,), context + 1, device="cuda", dtype=torch.int32), block_table=table,
        slot_mapping=table[:, context // PAGE].long() * PAGE + context % PAGE, block_size=PAGE)
    ids = torch.randint(0, head.config.vocab_size, (batch,), device="cuda")
    hidden = torch.randn(batch, head.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    return caches, (ids, pos, hidden, meta)


def step(head, cache, inputs) -> torch.Tensor:  # [batch] draft ids
    ids, pos, hidden, meta = inputs
    y, _ = head(ids, pos, hidden, [cache], [meta])
    return head.compute_logits(y).argmax(-1)


def time_ms(fn, iters: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@torch.no_grad()
def graph_ms(head, caches, inputs) -> float | str:
    graphs = []
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for c in caches:
                step(head, c, inputs)
        torch.cuda.current_stream().wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        for c in caches:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                step(head, c, inputs)
            graphs.append(g)
    except Exception as err:  # noqa: BLE001 - recorded in the results, not hidden
        return f"capture failed: {type(err).__name__}: {str(err)[:200]}"
    for g in graphs:
        g.replay()
    return time_ms(lambda i: graphs[i % CACHES].replay())


def read_bytes(head, inputs, context: int) -> int:
    """What a step must read: every non-expert weight it uses, the experts hit, the KV it attends."""
    layer = head.layers[0]
    moe = layer.mlp
    _, ids = route(moe.gate(layer.post_attention_layernorm(inputs[2])), moe.gate.e_score_correction_bias, moe.shape)
    expert = sum(t.numel() * t.element_size() for t in moe.experts["0"].buffers()) or weight_bytes(moe.experts["0"])
    other = weight_bytes(layer) - len(moe.experts) * expert - weight_bytes(layer.embed_tokens)
    kv = inputs[0].shape[0] * (context + 1) * layer.self_attn.shape.cache_width * 2
    return other + int(ids.unique().numel()) * expert + kv + inputs[0].shape[0] * layer.embed_tokens.weight.shape[1] * 2


def parts(head, cache, inputs) -> dict:
    """The step's pieces, each a closure over fixed inputs (for a per-part graph timing)."""
    from drafter.attention.mla import paged_mla_attention

    ids, pos, hidden, meta = inputs
    layer = head.layers[0]
    attn, moe = layer.self_attn, layer.mlp
    x = hidden
    q_nope, q_pe, _ = attn.project(x, pos)
    q = torch.cat((torch.einsum("nhd,hdc->nhc", q_nope, attn.w_uk), q_pe), dim=-1)
    latent = torch.randn(x.shape[0], attn.num_local_heads * attn.shape.v_head_dim, device="cuda",
                         dtype=torch.bfloat16)
    bias = moe.gate.e_score_correction_bias
    weights, expert_ids = route(moe.gate(x), bias, moe.shape)
    return {
        "embed+eh_proj": lambda: layer.eh_proj(torch.cat((layer.enorm(layer.embed_tokens(ids)), layer.hnorm(x)), -1)),
        "attention": lambda: attn(x, pos, cache, meta),
        "attention.project": lambda: attn.project(x, pos),
        "attention.attend": lambda: paged_mla_attention(q, cache, meta, attn.shape.softmax_scale, attn.shape.kv_lora_rank),
        "attention.o_proj": lambda: attn.o_proj(latent),
        "moe": lambda: moe(x),
        "moe.route": lambda: route(moe.gate(x), bias, moe.shape),
        "moe.routed_experts": lambda: moe._routed_grouped(x, weights, expert_ids),
        "moe.shared_expert": lambda: moe.shared_experts(x),
        "logits+argmax": lambda: head.compute_logits(x).argmax(-1),
    }


@torch.no_grad()
def breakdown(head, batch: int, context: int) -> dict:
    caches, inputs = decode_case(head, batch, context)
    out = {}
    for name, fn in parts(head, caches[0], inputs).items():
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        out[name] = round(time_ms(lambda i: g.replay()), 3)
    return out


@torch.no_grad()
def gemm_sweep(head, batch: int, log) -> list[dict]:
    """The routed experts' gate projection at this batch under each launch shape, graph-timed."""
    from drafter.kernels.fp8_gemm import BLOCK_M, GemmLaunch, grouped_gemm
    from drafter.models.moe import plan_slots

    moe = head.layers[0].mlp
    x = torch.randn(batch, head.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    _, ids = route(moe.gate(x), moe.gate.e_score_correction_bias, moe.shape)
    rows, _, experts = plan_slots(ids, 0, len(moe.experts), BLOCK_M)
    out = []
    for proj in ("gate_proj", "down_proj"):
        weight, scale, block = moe.stacked[proj]
        xin = x if proj == "gate_proj" else torch.randn(batch, weight.shape[2], device="cuda", dtype=torch.bfloat16)
        for bn in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4, 5):
                    launch = GemmLaunch(bn, warps, stages)
                    try:
                        grouped_gemm(xin, rows, experts, weight, scale, block, launch)
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            grouped_gemm(xin, rows, experts, weight, scale, block, launch)
                        ms = time_ms(lambda i: g.replay())
                    except Exception as err:  # noqa: BLE001 - a shape that does not compile is recorded
                        ms = f"{type(err).__name__}"
                    out.append(dict(batch=batch, proj=proj, block_n=bn, warps=warps, stages=stages, ms=ms))
        best = min((r for r in out if r["proj"] == proj and isinstance(r["ms"], float)), key=lambda r: r["ms"])
        log(f"gemm sweep batch {batch} {proj}: best {best}")
    return out


@torch.no_grad()
def moe_agreement(head, batch: int = 8) -> float:
    """Largest relative difference between the grouped-kernel MoE and the per-expert loop (torch's
    dequantise-and-matmul for every expert), on one random batch: the GPU path's sanity check."""
    moe = head.layers[0].mlp
    x = torch.randn(batch, head.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    grouped = moe(x).float()
    stacked, moe.stacked = moe.stacked, None
    kernels = [m for m in moe.modules() if isinstance(m, FP8Linear)]
    for m in kernels:
        m.kernel = False
    try:
        loop = moe(x).float()
    finally:
        moe.stacked = stacked
        for m in kernels:
            m.kernel = True
    return float((grouped - loop).abs().max() / loop.abs().max())


@torch.no_grad()
def attention_agreement(head, batch: int = 8, context: int = 300) -> float:
    """Largest relative difference between the MLA attention kernel and torch's gathered form."""
    from drafter.attention.mla import paged_mla_attention, paged_mla_attention_gathered

    caches, (ids, pos, hidden, meta) = decode_case(head, batch, context)
    attn = head.layers[0].self_attn
    q = torch.randn(batch, attn.num_local_heads, attn.shape.cache_width, device="cuda", dtype=torch.bfloat16)
    args = (q, caches[0], meta, attn.shape.softmax_scale, attn.shape.kv_lora_rank)
    kernel, torch_form = paged_mla_attention(*args).float(), paged_mla_attention_gathered(*args).float()
    return float((kernel - torch_form).abs().max() / torch_form.abs().max())


def probe(args, weights: str, bandwidth: float, log) -> list[dict]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    head = random_head(weights == "fp8")
    wbytes = weight_bytes(head)
    log(f"[{weights}] built in {time.perf_counter() - t0:.1f} s, weights {wbytes / 2**30:.2f} GiB")
    rows = [dict(weights=weights, moe_kernel_vs_torch_max_rel_diff=moe_agreement(head),
                 attention_kernel_vs_torch_max_rel_diff=attention_agreement(head))]
    log(json.dumps(rows[0]))
    for batch in args.sweep:
        rows += gemm_sweep(head, batch, log)
    for batch in args.batches:
        caches, inputs = decode_case(head, batch, args.context)
        with torch.no_grad():
            for c in caches:
                step(head, c, inputs)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            eager = time_ms(lambda i: step(head, caches[i % CACHES], inputs), iters=10)
            peak = torch.cuda.max_memory_allocated() - base
            floor_ms = read_bytes(head, inputs, args.context) / bandwidth * 1e3
        replay = graph_ms(head, caches, inputs)
        row = dict(weights=weights, batch=batch, context=args.context, eager_ms=round(eager, 3),
                   graph_ms=round(replay, 3) if isinstance(replay, float) else replay,
                   read_floor_ms=round(floor_ms, 3), weight_gib=round(wbytes / 2**30, 3),
                   kv_bytes_per_token=head.config.layers[0].attn.cache_width * 2,
                   step_peak_mib=round(peak / 2**20, 1))
        if batch in args.breakdown:
            row["parts_graph_ms"] = breakdown(head, batch, args.context)
        log(json.dumps(row))
        rows.append(row)
        del caches, inputs
    del head
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--weights", default="fp8,bf16")
    p.add_argument("--breakdown", default="1,64", help="batches whose step is also timed part by part")
    p.add_argument("--sweep", default="", help="batches at which to sweep the expert GEMM's launch shapes")
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.breakdown = [int(b) for b in args.breakdown.split(",") if b]
    args.sweep = [int(b) for b in args.sweep.split(",") if b]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    result = dict(device=props.name, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  torch=torch.__version__, copy_bandwidth_gbs=round(bandwidth / 1e9, 1),
                  command="python bench/probe_deepseek_mtp.py " + " ".join(
                      f"--{k} {v}" for k, v in [("batches", ",".join(map(str, args.batches))),
                                                 ("context", args.context), ("weights", args.weights)]),
                  rows=[])
    print(f"{props.name}: copy {bandwidth / 1e9:.0f} GB/s", flush=True)
    for weights in args.weights.split(","):
        result["rows"] += probe(args, weights, bandwidth, lambda s: print(s, flush=True))
        (out / "probe_deepseek_mtp.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
