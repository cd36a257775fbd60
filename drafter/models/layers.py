"""Llama building blocks shared by every draft head and the reference target.

Weight names follow the Hugging Face Llama layout (q_proj/k_proj/v_proj/o_proj,
gate_proj/up_proj/down_proj) so checkpoints load without renaming.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from drafter.attention.metadata import AttentionMetadata
from drafter.models.rope import Rope, apply_rope  # noqa: F401 - apply_rope: the one rotary for the torch path
from drafter.models.sharding import SINGLE, Shard, row_parallel


@dataclass(frozen=True)
class LayerShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int | None = None  # None = full attention
    rope: Rope | None = None  # None = plain rope of rope_theta over the whole head
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @property
    def rotary(self) -> Rope:
        return self.rope if self.rope is not None else Rope.plain(self.rope_theta, self.head_dim)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """GQA self-attention whose KV lives in a paged cache owned by the engine.

    Tensor parallel: `shape` is this rank's share (drafter.models.llama_shard.shard_spec: its own
    query and KV heads); o_proj's partial sums are added over ranks."""

    def __init__(self, shape: LayerShape, input_size: int | None = None, shard: Shard = SINGLE):
        super().__init__()
        in_size = input_size or shape.hidden_size
        self.shape = shape
        self.shard = shard
        self.rope = shape.rotary
        self.q_proj = nn.Linear(in_size, shape.num_heads * shape.head_dim, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(in_size, shape.num_kv_heads * shape.head_dim, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(in_size, shape.num_kv_heads * shape.head_dim, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(shape.num_heads * shape.head_dim, shape.hidden_size, bias=shape.o_bias)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, input_size]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        s = self.shape
        n = x.shape[0]
        q = self.q_proj(x).view(n, s.num_heads, s.head_dim)
        k = self.k_proj(x).view(n, s.num_kv_heads, s.head_dim)
        v = self.v_proj(x).view(n, s.num_kv_heads, s.head_dim)
        q = apply_rope(q, positions, self.rope)
        k = apply_rope(k, positions, self.rope)
        out = backend.forward(q, k, v, kv_cache, meta, sliding_window=s.sliding_window)
        return row_parallel(self.o_proj, out.reshape(n, s.num_heads * s.head_dim), self.shard)


class MLP(nn.Module):
    """SiLU-gated MLP; tensor parallel: gate / up rows (intermediate_size is this rank's share)
    and down_proj's columns split, its partial sums added over ranks."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, shard: Shard = SINGLE):
        super().__init__()
        self.shard = shard
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        return row_parallel(self.down_proj, F.silu(self.gate_proj(x)) * self.up_proj(x), self.shard)


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer.  `input_norm=False` is EAGLE-1's first layer, whose
    input is already the fc projection and carries no input_layernorm."""

    def __init__(self, shape: LayerShape, input_norm: bool = True, shard: Shard = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(shape, shard=shard)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape.hidden_size, shape.intermediate_size, shape.mlp_bias, shard)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], the residual stream after the layer
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        x = x + self.self_attn(h, positions, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))
