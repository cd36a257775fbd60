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
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from drafter.models import fused_kernels as K
from drafter.models.heads import DraftHead, Eagle3Head, Eagle3Layer
from drafter.models.layers import MLP, Attention, DecoderLayer, RMSNorm


def _concat_weights(linears: list[nn.Linear]) -> torch.Tensor:
    """One [sum(out), in] matrix whose row blocks are the given layers' weights (now views of it)."""
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0).contiguous()
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start:start + rows]
        start += rows
    return fused


def fuse_head(head: DraftHead) -> DraftHead:
    """Switch a head (already on its device and dtype) to the fused path; returns it.
    Idempotent: engines sharing one head (several k in a benchmark) fuse it once."""
    if getattr(head, "fused", False):
        return head
    head.fused = True
    for m in head.modules():
        if isinstance(m, Attention):
            if any(p.bias is not None for p in (m.q_proj, m.k_proj, m.v_proj)):
                raise ValueError("fused attention expects bias-free q/k/v projections")
            m.qkv_weight = _concat_weights([m.q_proj, m.k_proj, m.v_proj])
            d = m.shape.head_dim
            # the same table apply_rope computes on every call
            m.inv_freq = 1.0 / (m.shape.rope_theta ** (
                torch.arange(0, d, 2, device=m.qkv_weight.device, dtype=torch.float32) / d))
        elif isinstance(m, MLP):
            m.gate_up_weight = _concat_weights([m.gate_proj, m.up_proj])
        for cls, fn in _FORWARDS:
            if isinstance(m, cls):
                m.forward = types.MethodType(fn, m)
                break
    head.greedy_draft = types.MethodType(greedy_draft, head)
    return head


def unfuse_head(head: DraftHead) -> DraftHead:
    """Back to the modules' own torch forwards (the fused weights stay; they are the same numbers)."""
    for m in head.modules():
        m.__dict__.pop("forward", None)
    head.__dict__.pop("greedy_draft", None)
    head.fused = False
    return head


def greedy_draft(head: DraftHead, hidden: torch.Tensor, step: int) -> torch.Tensor:
    """Greedy draft ids in the target vocabulary: the lm_head GEMM, then argmax and the d2t map in
    one launch (torch needs three).  hidden [rows, hidden_size] -> [rows] int64."""
    d2t = head.d2t if isinstance(head, Eagle3Head) else None
    return K.greedy_ids(head.compute_logits(hidden, step), d2t)


def rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
    if x.dim() != 2 or x.stride(-1) != 1:
        return K.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), norm.weight, norm.eps).view(x.shape)
    return K.rms_norm(x, norm.weight, norm.eps)


def attention(attn: Attention, x: torch.Tensor, positions, kv_cache, meta, backend) -> torch.Tensor:
    """x [num_tokens, input_size] -> attention output before o_proj, [num_tokens, num_heads * head_dim]."""
    s = attn.shape
    qkv = F.linear(x, attn.qkv_weight)
    out = backend.forward_rope(qkv, positions, attn.inv_freq, s.num_heads, kv_cache, meta, s.sliding_window)
    return out.view(x.shape[0], s.num_heads * s.head_dim)


def mlp_into(mlp: MLP, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual += mlp(h), in place (residual must be a fresh tensor the caller owns)."""
    act = K.silu_mul(F.linear(h, mlp.gate_up_weight))
    return residual.addmm_(act, mlp.down_proj.weight.t())


def mlp(m: MLP, h: torch.Tensor) -> torch.Tensor:
    return m.down_proj(K.silu_mul(F.linear(h, m.gate_up_weight)))


def attention_module(attn: Attention, x, positions, kv_cache, meta, backend) -> torch.Tensor:
    return attn.o_proj(attention(attn, x, positions, kv_cache, meta, backend))


def _attention_then_mlp(layer, attn_in, residual, positions, kv_cache, meta, backend) -> torch.Tensor:
    a = layer.self_attn.o_proj(attention(layer.self_attn, attn_in, positions, kv_cache, meta, backend))
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


def eagle3_head(head: Eagle3Head, input_ids, positions, hidden, kv_caches, metas, backend, step: int = 0):
    """Eagle3Head.forward with the embedding gather and both input norms in one launch."""
    first, *rest = head.layers
    attn_in = K.embed_dual_norm(input_ids, head.embed_tokens.weight, hidden, first.input_layernorm.weight,
                                first.hidden_norm.weight, first.input_layernorm.eps)
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
