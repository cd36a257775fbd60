"""The fused forward path of the draft heads, for the GPU with the Triton backend.

`fuse_head(head)` concatenates q/k/v and gate/up weights into single matrices (the original
parameters become views into them, so memory is not doubled and checkpoints still load)
and binds the functions below as the modules' forward (instance attributes: the classes,
and every unfused head, keep the plain torch code that the reference path runs).  Per layer that leaves the
weight-streaming GEMMs plus a few fused launches:

    qkv GEMM -> rotary + KV write -> paged attention -> o GEMM + residual
    -> gate/up GEMM from the normed rows, SiLU * up -> down GEMM + residual [-> lm_head from the normed rows]

The math is the modules' own; only the launch structure and the rounding points of the
GEMM accumulations differ (a fused GEMM sums in f32 before its one cast).

Each weight GEMM goes through a `WeightGemm` (drafter.kernels.weight_gemm): for the few rows of a
draft step it runs drafter's skinny GEMM where that streams the weights faster than cuBLAS on
this device, with the residual add, SiLU * up and the RMSNorms folded into the GEMMs (the GEMM
that produces a norm's input also writes its sums of squares and input * norm weight, and the
next GEMM scales its rows by 1 / rms); otherwise cuBLAS with the norm and SiLU as their own
launches.
A greedy chain step hands the next step its layer input directly (`greedy_next_inputs`:
argmax, d2t, embedding and both input norms in one launch).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from drafter.kernels import fused_kernels as K
from drafter.models.heads import DraftHead, EagleHead, Eagle3Head, Eagle3Layer
from drafter.models.layers import MLP, Attention, DecoderLayer, RMSNorm
from drafter.kernels.skinny_gemm import NormedInput
from drafter.kernels.weight_gemm import WeightGemm, plan_gemm


def _concat_weights(linears: list[nn.Linear], name: str = "weight") -> torch.Tensor | None:
    """One [sum(out), in] matrix (name="bias": one [sum(out)] vector) whose row blocks are the given
    layers' parameters (now views of it); None where the layers have no such parameter."""
    params = [getattr(lin, name, None) for lin in linears]  # "weight_scale": FP8 layers only
    if any(p is None for p in params):
        return None
    fused = torch.cat([p.detach() for p in params], dim=0).contiguous()
    start = 0
    for p in params:
        rows = p.shape[0]
        p.data = fused[start:start + rows]
        start += rows
    return fused


def _scale(linear: nn.Module) -> torch.Tensor | None:
    """A per-channel FP8 linear's row scales [out] float32 (drafter.models.fp8.ChannelFP8Linear), else None."""
    return getattr(linear, "weight_scale", None)


def fuse_head(head: DraftHead, skinny: str = "auto") -> DraftHead:
    """Switch a head (already on its device and dtype) to the fused path; returns it.
    skinny: "auto" (time the skinny kernel against cuBLAS per weight), "on" or "off"; per-channel
    FP8 weights always take drafter.kernels.fp8_channel, with tiles timed per weight under "auto".
    Idempotent: engines sharing one head (several k in a benchmark) fuse it once."""
    if getattr(head, "fused", False):
        return head
    head.fused = True
    act_dtype = next((p.dtype for p in head.parameters()), torch.float32)  # FP8 payloads are buffers

    def gemm(weight, normed=False, scale=None, **fused_work):
        """A normed GEMM's input is what residual_and_norm hands on: a NormedInput with x * norm
        weight after the skinny kernel (planned as scaled_configs), normed rows after cuBLAS
        (planned as plain input).  scale [N]: the weight is per-channel FP8 (--weights fp8), whose
        kernel dequantises it (drafter.kernels.fp8_channel)."""
        timings = {}
        if scale is not None:
            from drafter.kernels.fp8_channel import ChannelFP8Gemm, plan_channel_gemm

            plan = plan_channel_gemm(weight, scale, silu_mul=fused_work.get("silu_mul", False),
                                     residual=fused_work.get("residual", False), dtype=act_dtype,
                                     timed=skinny == "auto", timings=timings)
            return ChannelFP8Gemm(weight, plan, plan_us=timings, scale=scale)
        plan = plan_gemm(weight, mode=skinny, timings=timings, **fused_work)
        scaled = {}
        if normed:
            timings["prescaled"] = {}
            scaled = plan_gemm(weight, mode=skinny, timings=timings["prescaled"], normed=True, prescaled=True,
                               **fused_work)
        return WeightGemm(weight, plan, plan_us=timings, scaled_configs=scaled)

    for m in head.modules():
        if isinstance(m, Attention):
            m.qkv_weight = _concat_weights([m.q_proj, m.k_proj, m.v_proj])
            m.qkv_bias = _concat_weights([m.q_proj, m.k_proj, m.v_proj], "bias")  # [q + 2 kv widths] or None
            m.qkv_gemm = gemm(m.qkv_weight, scale=_concat_weights([m.q_proj, m.k_proj, m.v_proj], "weight_scale"))
            m.o_gemm = gemm(m.o_proj.weight, residual=True, scale=_scale(m.o_proj))
            m.rope_tables = m.rope.tables(m.qkv_weight.device)  # the inverse frequencies apply_rope uses
        elif isinstance(m, MLP):
            m.gate_up_weight = _concat_weights([m.gate_proj, m.up_proj])
            m.gate_up_bias = _concat_weights([m.gate_proj, m.up_proj], "bias")
            # with biases the SiLU waits for the bias add: its own launch after a plain GEMM
            m.gate_up_gemm = gemm(m.gate_up_weight, silu_mul=m.gate_up_bias is None, normed=True,
                                  scale=_concat_weights([m.gate_proj, m.up_proj], "weight_scale"))
            m.down_gemm = gemm(m.down_proj.weight, residual=True, scale=_scale(m.down_proj))
        for cls, fn in _FORWARDS:
            if isinstance(m, cls):
                m.forward = types.MethodType(fn, m)
                break
    fc = getattr(head, "fc", None)
    if _scale(fc) is not None:  # an FP8 fc keeps its module forward, through a planned kernel
        fc.gemm = gemm(fc.weight, scale=fc.weight_scale)
    if isinstance(head, (EagleHead, Eagle3Head)):
        head.lm_head_gemm = gemm(head.lm_head.weight, normed=isinstance(head, Eagle3Head), argmax=True,
                                 scale=_scale(head.lm_head))
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


def compute_logits(head: DraftHead, hidden: torch.Tensor | NormedInput, step: int = 0) -> torch.Tensor:
    """EAGLE-1 / EAGLE-3 lm_head: [rows, hidden_size] (or rows it norms first) -> [rows, head_vocab]."""
    return head.lm_head_gemm(hidden)


def greedy_draft(head: DraftHead, hidden: torch.Tensor | NormedInput, step: int) -> torch.Tensor:
    """Greedy draft ids in the target vocabulary: the lm_head GEMM, then argmax and the d2t map in
    one launch (torch needs three).  hidden [rows, hidden_size] -> [rows] int64."""
    d2t = head.d2t if isinstance(head, Eagle3Head) else None
    if not hasattr(head, "lm_head_gemm"):  # MTP: a norm and a per-layer head
        return K.greedy_ids(head.compute_logits(hidden, step), d2t)
    return K.greedy_ids(head.lm_head_gemm.greedy_scores(hidden), d2t)


def greedy_next_inputs(head: Eagle3Head, logit_h: torch.Tensor | NormedInput, carry_h: torch.Tensor, step: int):
    """A greedy chain step that another step follows: (draft ids [rows] int64, the next step's
    layer input [rows, 2 * hidden_size]).  The lm_head GEMM, then argmax + d2t + embedding +
    both input norms in one launch."""
    first = head.layers[0]
    return K.greedy_embed_dual_norm(head.lm_head_gemm.greedy_scores(logit_h), head.d2t, head.embed_tokens.weight,
                                    carry_h, first.input_layernorm.weight, first.hidden_norm.weight,
                                    first.input_layernorm.eps)


def rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
    if x.dim() != 2 or x.stride(-1) != 1:
        return K.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), norm.weight, norm.eps).view(x.shape)
    return K.rms_norm(x, norm.weight, norm.eps)


def attention(attn: Attention, x: torch.Tensor, positions, kv_cache, meta, backend) -> torch.Tensor:
    """x [num_tokens, input_size] -> attention output before o_proj, [num_tokens, num_heads * head_dim]."""
    s = attn.shape
    qkv = attn.qkv_gemm(x)
    if attn.qkv_bias is not None:
        qkv = qkv + attn.qkv_bias
    out = backend.forward_rope(qkv, positions, attn.rope_tables, s.num_heads, kv_cache, meta, s.sliding_window)
    return out.view(x.shape[0], s.num_heads * s.head_dim)


def _plus_bias(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """x + linear.bias (a new tensor), or x itself for a bias-free layer: [rows, out]."""
    return x if linear.bias is None else x + linear.bias


def _activation(m: MLP, h: torch.Tensor | NormedInput) -> torch.Tensor:
    """silu(gate(h)) * up(h), [rows, intermediate]: in the GEMM's epilogue, or after the bias add."""
    if m.gate_up_bias is None:
        return m.gate_up_gemm(h, silu_mul=True)
    return K.silu_mul(m.gate_up_gemm(h) + m.gate_up_bias)


def mlp(m: MLP, h: torch.Tensor) -> torch.Tensor:
    return _plus_bias(m.down_gemm(_activation(m, h)), m.down_proj)


def attention_module(attn: Attention, x, positions, kv_cache, meta, backend) -> torch.Tensor:
    return _plus_bias(attn.o_gemm(attention(attn, x, positions, kv_cache, meta, backend)), attn.o_proj)


def _attention_then_mlp(layer, attn_in, residual, positions, kv_cache, meta, backend,
                        norm_after: RMSNorm | None = None):
    """The layer after its input norm: (residual stream out x [rows, hidden], and with norm_after
    what that norm hands the next GEMM (WeightGemm.residual_and_norm), else None).

        s = residual + o(attention(attn_in))       o GEMM, residual epilogue, sums of squares, s * w
        x = s + down(silu(gate(n)) * up(n))        n = post_attention_layernorm(s), a row scale
    """
    attn = layer.self_attn
    norm = layer.post_attention_layernorm
    residual = _plus_bias(residual, attn.o_proj)  # an o_proj bias rides on the residual the GEMM adds
    s, h = attn.o_gemm.residual_and_norm(attention(attn, attn_in, positions, kv_cache, meta, backend), residual,
                                         norm.weight, norm.eps)
    act = _activation(layer.mlp, h)
    s = _plus_bias(s, layer.mlp.down_proj)
    if norm_after is None:
        return layer.mlp.down_gemm(act, residual=s, out=s), None  # s is ours: accumulate in place
    return layer.mlp.down_gemm.residual_and_norm(act, s, norm_after.weight, norm_after.eps, out=s)


def decoder_layer(layer: DecoderLayer, x, positions, kv_cache, meta, backend) -> torch.Tensor:
    h = layer.input_layernorm(x) if layer.input_layernorm is not None else x
    return _attention_then_mlp(layer, h, x, positions, kv_cache, meta, backend)[0]


def eagle3_layer(layer: Eagle3Layer, embeds, hidden, positions, kv_cache, meta, backend) -> torch.Tensor:
    attn_in = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hidden)), dim=-1)
    residual = attn_in[:, hidden.shape[1]:] if layer.norm_before_residual else hidden
    return _attention_then_mlp(layer, attn_in, residual, positions, kv_cache, meta, backend)[0]


def eagle3_head(head: Eagle3Head, input_ids, positions, hidden, kv_caches, metas, backend, step: int = 0,
                layer_input: torch.Tensor | None = None):
    """Eagle3Head.forward with the embedding gather and both input norms in one launch, or none:
    layer_input [rows, 2 * hidden_size] is that launch's result when greedy_next_inputs made it.

    Draft steps (step > 0) hand back the logits' input as the down GEMM left it for the final
    norm (a NormedInput: the lm_head GEMM applies the norm as a row scale); every consumer of it
    goes through compute_logits.  The first pass returns the normed rows: the proposer gathers
    its sampled rows first."""
    first, *rest = head.layers
    attn_in = layer_input if layer_input is not None else K.embed_dual_norm(
        input_ids, head.embed_tokens.weight, hidden, first.input_layernorm.weight, first.hidden_norm.weight,
        first.input_layernorm.eps)
    residual = attn_in[:, hidden.shape[1]:] if first.norm_before_residual else hidden
    x, normed = _attention_then_mlp(first, attn_in, residual, positions, kv_caches[0],
                                    metas[head.kv_group_of_layer[0]], backend,
                                    head.norm if step > 0 and not rest else None)
    for i, layer in enumerate(rest, start=1):
        x = layer(x, positions, kv_caches[i], metas[head.kv_group_of_layer[i]], backend)
    if normed is not None:
        return normed, x
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
