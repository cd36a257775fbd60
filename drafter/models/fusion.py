"""The fused forward path of the draft heads, for the GPU with the Triton backend.

`fuse_head(head)` concatenates q/k/v and gate/up weights into single matrices (the original
parameters become views into them, so memory is not doubled and checkpoints still load)
and binds the functions below as the modules' forward (instance attributes: the classes,
and every unfused head, keep the plain torch code that the reference path runs).  Per layer that leaves the
weight-streaming GEMMs plus a few fused launches:

    qkv GEMM -> rotary + KV write -> paged attention -> o GEMM -> residual add + norm
    -> gate/up GEMM -> SiLU * up -> down GEMM accumulated into the residual (addmm_)

The math is the modules' own; only the launch structure and the rounding points of the
GEMM accumulations differ (a fused GEMM sums in f32 before its one cast).

Each weight GEMM goes through a `WeightGemm`: for the few rows of a draft step it may run
drafter's skinny GEMM (SiLU * up and the residual add fused into it) where that streams the
weights faster than cuBLAS on this device (`choose_skinny_buckets` times both at fuse time).
With a `WeightPrefetcher`, the o projection's weights are read into L2 while rotary, KV write
and attention run, and the next step's q/k/v weights while argmax and the embedding run.
A greedy chain step hands the next step its layer input directly (`greedy_next_inputs`:
argmax, d2t, embedding and both input norms in one launch).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
from torch import nn

from drafter.cuda_timing import graph_time_us
from drafter.models import fused_kernels as K
from drafter.models.heads import DraftHead, EagleHead, Eagle3Head, Eagle3Layer
from drafter.models.layers import MLP, Attention, DecoderLayer, RMSNorm
from drafter.models.prefetch import WeightPrefetcher
from drafter.models.skinny_gemm import MAX_ROWS, block_m_for, skinny_gemm

ROW_BUCKETS = (16, 32, 64)  # the skinny kernel's row-block sizes: one decision per bucket


@dataclass
class WeightGemm:
    """x @ weight.T for one weight matrix [N, K], by the skinny kernel for the row buckets in
    `skinny_buckets` and by cuBLAS otherwise; the optional epilogues give the same numbers
    either way (up to the GEMM's summation order)."""
    weight: torch.Tensor  # [N, K]; silu_mul: [2 * N', K] = [gate; up]
    skinny_buckets: frozenset = frozenset()

    def __call__(self, x: torch.Tensor, *, residual: torch.Tensor | None = None,
                 silu_mul: bool = False) -> torch.Tensor:
        """x [m, K] -> [m, N] (silu_mul: [m, N / 2]); residual [m, N] is updated in place and returned."""
        m = x.shape[0]
        if m <= MAX_ROWS and block_m_for(m) in self.skinny_buckets and x.stride(1) == 1:
            return skinny_gemm(x, self.weight, residual=residual, silu_mul=silu_mul, out=residual)
        if residual is not None:
            return residual.addmm_(x, self.weight.t())
        y = F.linear(x, self.weight)
        return K.silu_mul(y) if silu_mul else y


def choose_skinny_buckets(weight: torch.Tensor, silu_mul: bool = False, residual: bool = False) -> frozenset:
    """The row buckets where the skinny kernel beats cuBLAS on this weight (CUDA: device time of
    graph replays over three weight copies, so neither side finds the weights in L2; CPU: every
    bucket, so that the interpreter covers the kernel in tests)."""
    if weight.device.type != "cuda":
        return frozenset(ROW_BUCKETS)
    copies = [weight] + [weight.clone() for _ in range(2)]
    chosen = set()
    for bucket in ROW_BUCKETS:
        x = torch.randn(bucket, weight.shape[1], device=weight.device, dtype=weight.dtype)
        n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
        res = torch.zeros(bucket, n, device=weight.device, dtype=weight.dtype) if residual else None
        times = {}
        for name, buckets in (("cublas", frozenset()), ("skinny", frozenset([bucket]))):
            gemms = [WeightGemm(w, buckets) for w in copies]
            try:
                times[name] = graph_time_us(lambda i: gemms[i % 3](x, residual=res, silu_mul=silu_mul), calls=6)
            except triton.runtime.errors.OutOfResources:  # block sizes this GPU cannot hold: cuBLAS
                times[name] = float("inf")
        if times["skinny"] < times["cublas"]:
            chosen.add(bucket)
    del copies
    return frozenset(chosen)


def _concat_weights(linears: list[nn.Linear]) -> torch.Tensor:
    """One [sum(out), in] matrix whose row blocks are the given layers' weights (now views of it)."""
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start:start + rows]
        start += rows
    return fused


def fuse_head(head: DraftHead, prefetcher: WeightPrefetcher | None = None, skinny: str = "auto") -> DraftHead:
    """Switch a head (already on its device and dtype) to the fused path; returns it.
    skinny: "auto" (time the skinny kernel against cuBLAS per weight), "on" or "off".
    Idempotent: engines sharing one head (several k in a benchmark) fuse it once."""
    if getattr(head, "fused", False):
        return head
    head.fused = True
    head.prefetcher = prefetcher

    def gemm(weight, **epilogue):
        if skinny == "off":
            return WeightGemm(weight)
        return WeightGemm(weight, frozenset(ROW_BUCKETS) if skinny == "on" else choose_skinny_buckets(
            weight, **epilogue))

    for m in head.modules():
        if isinstance(m, Attention):
            if any(p.bias is not None for p in (m.q_proj, m.k_proj, m.v_proj)):
                raise ValueError("fused attention expects bias-free q/k/v projections")
            m.qkv_weight = _concat_weights([m.q_proj, m.k_proj, m.v_proj])
            m.qkv_gemm = gemm(m.qkv_weight)
            m.o_gemm = gemm(m.o_proj.weight)
            m.prefetcher = prefetcher
            d = m.shape.head_dim
            # the same table apply_rope computes on every call
            m.inv_freq = 1.0 / (m.shape.rope_theta ** (
                torch.arange(0, d, 2, device=m.qkv_weight.device, dtype=torch.float32) / d))
        elif isinstance(m, MLP):
            m.gate_up_weight = _concat_weights([m.gate_proj, m.up_proj])
            m.gate_up_gemm = gemm(m.gate_up_weight, silu_mul=True)
            m.down_gemm = gemm(m.down_proj.weight, residual=True)
        for cls, fn in _FORWARDS:
            if isinstance(m, cls):
                m.forward = types.MethodType(fn, m)
                break
    if isinstance(head, (EagleHead, Eagle3Head)):
        head.lm_head_gemm = gemm(head.lm_head.weight)
        head.compute_logits = types.MethodType(compute_logits, head)
    head.greedy_draft = types.MethodType(greedy_draft, head)
    if isinstance(head, Eagle3Head) and len(head.layers) == 1:
        head.greedy_next_inputs = types.MethodType(greedy_next_inputs, head)
    return head


def unfuse_head(head: DraftHead) -> DraftHead:
    """Back to the modules' own torch forwards (the fused weights stay; they are the same numbers)."""
    for m in head.modules():
        m.__dict__.pop("forward", None)
    for name in ("greedy_draft", "greedy_next_inputs", "compute_logits"):
        head.__dict__.pop(name, None)
    head.fused = False
    return head


def compute_logits(head: DraftHead, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
    """EAGLE-1 / EAGLE-3 lm_head: [rows, hidden_size] -> [rows, head_vocab]."""
    return head.lm_head_gemm(hidden)


def greedy_draft(head: DraftHead, hidden: torch.Tensor, step: int) -> torch.Tensor:
    """Greedy draft ids in the target vocabulary: the lm_head GEMM, then argmax and the d2t map in
    one launch (torch needs three).  hidden [rows, hidden_size] -> [rows] int64."""
    d2t = head.d2t if isinstance(head, Eagle3Head) else None
    return K.greedy_ids(head.compute_logits(hidden, step), d2t)


def greedy_next_inputs(head: Eagle3Head, logit_h: torch.Tensor, carry_h: torch.Tensor, step: int):
    """A greedy chain step that another step follows: (draft ids [rows] int64, the next step's
    layer input [rows, 2 * hidden_size]).  The lm_head GEMM, then argmax + d2t + embedding +
    both input norms in one launch, while the next q/k/v weights stream into L2."""
    logits = head.compute_logits(logit_h, step)
    first = head.layers[0]
    if head.prefetcher is not None:
        head.prefetcher.prefetch(first.self_attn.qkv_weight)
    return K.greedy_embed_dual_norm(logits, head.d2t, head.embed_tokens.weight, carry_h,
                                    first.input_layernorm.weight, first.hidden_norm.weight,
                                    first.input_layernorm.eps)


def rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
    if x.dim() != 2 or x.stride(-1) != 1:
        return K.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), norm.weight, norm.eps).view(x.shape)
    return K.rms_norm(x, norm.weight, norm.eps)


def attention(attn: Attention, x: torch.Tensor, positions, kv_cache, meta, backend) -> torch.Tensor:
    """x [num_tokens, input_size] -> attention output before o_proj, [num_tokens, num_heads * head_dim]."""
    s = attn.shape
    qkv = attn.qkv_gemm(x)
    if attn.prefetcher is not None:  # read o_proj into L2 while rotary and attention run
        attn.prefetcher.prefetch(attn.o_proj.weight)
    out = backend.forward_rope(qkv, positions, attn.inv_freq, s.num_heads, kv_cache, meta, s.sliding_window)
    return out.view(x.shape[0], s.num_heads * s.head_dim)


def mlp_into(mlp: MLP, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual += mlp(h), in place (residual must be a fresh tensor the caller owns)."""
    return mlp.down_gemm(mlp.gate_up_gemm(h, silu_mul=True), residual=residual)


def mlp(m: MLP, h: torch.Tensor) -> torch.Tensor:
    return m.down_gemm(m.gate_up_gemm(h, silu_mul=True))


def attention_module(attn: Attention, x, positions, kv_cache, meta, backend) -> torch.Tensor:
    return attn.o_gemm(attention(attn, x, positions, kv_cache, meta, backend))


def _attention_then_mlp(layer, attn_in, residual, positions, kv_cache, meta, backend) -> torch.Tensor:
    a = layer.self_attn.o_gemm(attention(layer.self_attn, attn_in, positions, kv_cache, meta, backend))
    norm = layer.post_attention_layernorm
    h, x = K.rms_norm(a, norm.weight, norm.eps, residual=residual)  # x = residual + a (fresh)
    return mlp_into(layer.mlp, h, x)


def decoder_layer(layer: DecoderLayer, x, positions, kv_cache, meta, backend) -> torch.Tensor:
    h = layer.input_layernorm(x) if layer.input_layernorm is not None else x
    return _attention_then_mlp(layer, h, x, positions, kv_cache, meta, backend)


def eagle3_layer(layer: Eagle3Layer, embeds, hidden, positions, kv_cache, meta, backend) -> torch.Tensor:
    attn_in = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hidden)), dim=-1)
    residual = attn_in[:, hidden.shape[1]:] if layer.norm_before_residual else hidden
    return _attention_then_mlp(layer, attn_in, residual, positions, kv_cache, meta, backend)


def eagle3_head(head: Eagle3Head, input_ids, positions, hidden, kv_caches, metas, backend, step: int = 0,
                layer_input: torch.Tensor | None = None):
    """Eagle3Head.forward with the embedding gather and both input norms in one launch, or none:
    layer_input [rows, 2 * hidden_size] is that launch's result when greedy_next_inputs made it."""
    first, *rest = head.layers
    attn_in = layer_input if layer_input is not None else K.embed_dual_norm(
        input_ids, head.embed_tokens.weight, hidden, first.input_layernorm.weight, first.hidden_norm.weight,
        first.input_layernorm.eps)
    residual = attn_in[:, hidden.shape[1]:] if first.norm_before_residual else hidden
    x = _attention_then_mlp(first, attn_in, residual, positions, kv_caches[0], metas[head.kv_group_of_layer[0]],
                            backend)
    for i, layer in enumerate(rest, start=1):
        x = layer(x, positions, kv_caches[i], metas[head.kv_group_of_layer[i]], backend)
    return head.norm(x), x


# most specific class first: MTPLayer is a DecoderLayer
_FORWARDS = (
    (Eagle3Head, eagle3_head),
    (Eagle3Layer, eagle3_layer),
    (DecoderLayer, decoder_layer),
    (Attention, attention_module),
    (MLP, mlp),
    (RMSNorm, rms_norm),
)
