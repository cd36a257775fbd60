"""The fused forward path of one tensor-parallel rank of a Llama-family head (EAGLE-1, EAGLE-3,
Llama-style MTP), for the GPU with the Triton backend.

fuse_head (drafter.models.fusion) folds the residual add and the next norm's sums of squares into
the o and down GEMMs' epilogues.  On a rank those GEMMs are row parallel: their output is this
rank's partial sum, whole only after the all-reduce, so a residual added there would be counted
once per rank and the sums of squares would be of a partial row.  What is exact on a shard is fused
here, with the same kernels:

    q / k / v rows of the rank's heads in one GEMM -> rotary + KV write in one launch -> paged attention
    gate / up rows of the rank's columns in one GEMM, SiLU * up in its epilogue
    each RMSNorm in one launch (on the whole hidden state every rank holds)
    o / down GEMMs plain, then the all-reduce, then the (replicated) bias; the residual adds stay
    in the layers' own torch code
The vocabulary-parallel embedding, the gathered fc / eh_proj and the rank's lm_head rows keep the
modules' code (drafter.models.heads; greedy drafts through Shard.greedy_ids).
"""

from __future__ import annotations

import types

import torch

from drafter.kernels.weight_gemm import WeightGemm, plan_gemm
from drafter.models.fusion import _activation, _concat_weights, _plus_bias, attention, rms_norm
from drafter.models.layers import MLP, Attention, RMSNorm


def fuse_sharded_head(head, skinny: str = "auto"):
    """Switch a rank's head (on its device and dtype, shard world > 1) to the fused per-shard path;
    returns it.  skinny: as fuse_head's ("auto" times the skinny kernel against cuBLAS per weight
    on this rank).  Idempotent."""
    if getattr(head, "fused", False):
        return head
    head.fused = True

    def gemm(weight: torch.Tensor, **work) -> WeightGemm:
        timings: dict = {}
        return WeightGemm(weight, plan_gemm(weight, mode=skinny, timings=timings, **work), plan_us=timings)

    for m in head.modules():
        if isinstance(m, Attention):
            parts = [m.q_proj, m.k_proj, m.v_proj]
            m.qkv_weight = _concat_weights(parts)
            m.qkv_bias = _concat_weights(parts, "bias")  # [q + 2 kv widths of this rank] or None
            m.qkv_gemm = gemm(m.qkv_weight)
            m.o_gemm = gemm(m.o_proj.weight)
            m.rope_tables = m.rope.tables(m.qkv_weight.device)
            m.forward = types.MethodType(sharded_attention, m)
        elif isinstance(m, MLP):
            m.gate_up_weight = _concat_weights([m.gate_proj, m.up_proj])
            m.gate_up_bias = _concat_weights([m.gate_proj, m.up_proj], "bias")
            m.gate_up_gemm = gemm(m.gate_up_weight, silu_mul=m.gate_up_bias is None)
            m.down_gemm = gemm(m.down_proj.weight)
            m.forward = types.MethodType(sharded_mlp, m)
        elif isinstance(m, RMSNorm):
            m.forward = types.MethodType(rms_norm, m)
    return head


def sharded_attention(attn: Attention, x, positions, kv_cache, meta, backend) -> torch.Tensor:
    """x [num_tokens, input_size] -> the whole attention output [num_tokens, hidden_size] (o_proj's
    partial products summed over ranks, its bias added once)."""
    partial = attn.o_gemm(attention(attn, x, positions, kv_cache, meta, backend))
    return _plus_bias(attn.shard.all_reduce(partial), attn.o_proj)


def sharded_mlp(m: MLP, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
    """down(silu(gate(x)) * up(x)) over this rank's columns, summed over ranks, bias added once."""
    return _plus_bias(m.shard.all_reduce(m.down_gemm(_activation(m, x))), m.down_proj)
