"""DeepSeek's multi-head latent attention (MLA) over a paged compressed KV cache, absorbed form.

Projections (checkpoint names):
    q   = q_b_proj(q_a_layernorm(q_a_proj(x)))            [n, H, nope + rope]   (q_proj(x) without q_lora)
    kv  = kv_a_proj_with_mqa(x) = [c_kv ; k_pe]          [n, kv_lora + rope], shared by all heads
    c_kv <- kv_a_layernorm(c_kv);  q_pe, k_pe rotated (interleaved pairs, deepseek yarn)
    kv_b_proj = per head [W_UK (nope rows) ; W_UV (v rows)] over the kv_lora latent
The cache keeps [c_kv ; k_pe] per token.  Attention is computed as
    score(t, s) = (q_nope W_UK) . c_kv[s] + q_pe . k_pe[s],  scaled by softmax_scale
    out = o_proj( W_UV (sum_s p(t, s) c_kv[s]) )
which equals the textbook form k_nope = W_UK c_kv, v = W_UV c_kv without ever expanding keys.

Tensor parallel: each rank holds num_heads / world heads (q_b_proj, kv_b_proj split by rows of
whole heads, o_proj by columns) and a full copy of the latent cache; o_proj's partial sums are
all-reduced.
"""

from __future__ import annotations

import torch
from torch import nn

from drafter.attention.metadata import AttentionMetadata
from drafter.attention.mla import paged_mla_attention, write_latent
from drafter.models.deepseek_config import MLAShape
from drafter.models.deepseek_rope import apply_interleaved_rope, cos_sin, inverse_frequencies
from drafter.models.fp8 import linear_weight, make_linear
from drafter.models.layers import RMSNorm
from drafter.models.sharding import SINGLE, Shard


class MLAAttention(nn.Module):
    def __init__(self, shape: MLAShape, fp8_block: tuple[int, int] | None, shard: Shard = SINGLE):
        super().__init__()
        s = shape
        self.shape, self.shard = s, shard
        self.num_local_heads = shard.span(s.num_heads, "num_attention_heads")[1]
        h = self.num_local_heads
        if s.q_lora_rank:
            self.q_a_proj = make_linear(s.hidden_size, s.q_lora_rank, fp8_block)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, s.rms_norm_eps)
            self.q_b_proj = make_linear(s.q_lora_rank, h * s.qk_head_dim, fp8_block)
        else:
            self.q_proj = make_linear(s.hidden_size, h * s.qk_head_dim, fp8_block)
        self.kv_a_proj_with_mqa = make_linear(s.hidden_size, s.cache_width, fp8_block)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, s.rms_norm_eps)
        self.kv_b_proj = make_linear(s.kv_lora_rank, h * (s.qk_nope_head_dim + s.v_head_dim), fp8_block)
        self.o_proj = make_linear(h * s.v_head_dim, s.hidden_size, fp8_block)
        # from kv_b_proj by absorb(): [heads, nope, kv_lora] and [heads, v, kv_lora]
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv", None, persistent=False)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def absorb(self, dtype: torch.dtype) -> None:
        """Split the (dequantised) kv_b_proj into W_UK and W_UV once, after the weights are loaded."""
        s = self.shape
        w = linear_weight(self.kv_b_proj, dtype).view(self.num_local_heads, -1, s.kv_lora_rank)
        self.w_uk = w[:, : s.qk_nope_head_dim].contiguous()
        self.w_uv = w[:, s.qk_nope_head_dim:].contiguous()

    def _inv_freq(self, device: torch.device) -> torch.Tensor:  # [rope_dim // 2] float32
        """The rope's inverse frequencies on `device`, made once per device (outside any graph
        capture: the first eager call makes them) and kept float32 whatever the model's dtype."""
        table = self._inv_freq_by_device.get(device)
        if table is None:
            table = inverse_frequencies(self.shape.rope, self.shape.qk_rope_head_dim).to(device)
            self._inv_freq_by_device[device] = table
        return table

    def project(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        positions: torch.Tensor,  # [num_tokens]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [n, H, nope], q_pe [n, H, rope] rotated, cache entries [n, kv_lora + rope])."""
        s = self.shape
        n = x.shape[0]
        q_in = self.q_a_layernorm(self.q_a_proj(x)) if s.q_lora_rank else x
        q = (self.q_b_proj(q_in) if s.q_lora_rank else self.q_proj(q_in)).view(n, -1, s.qk_head_dim)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        cos, sin = cos_sin(self._inv_freq(positions.device), s.rope, positions)
        q_pe = apply_interleaved_rope(q[..., s.qk_nope_head_dim:], cos, sin)
        k_pe = apply_interleaved_rope(k_pe[:, None, :], cos, sin)[:, 0]
        return q[..., : s.qk_nope_head_dim], q_pe, torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size]
        positions: torch.Tensor,  # [num_tokens]
        cache: torch.Tensor,  # [num_blocks, block_size, kv_lora + rope]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if self.w_uk is None:
            raise RuntimeError("MLAAttention.absorb() must run after the weights are loaded")
        s = self.shape
        q_nope, q_pe, entries = self.project(x, positions)
        write_latent(cache, entries, meta.slot_mapping)
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, self.w_uk)  # [n, H, kv_lora]
        latent = paged_mla_attention(torch.cat((q_latent, q_pe), dim=-1), cache, meta, s.softmax_scale,
                                     s.kv_lora_rank)
        out = torch.einsum("nhc,hvc->nhv", latent, self.w_uv).reshape(x.shape[0], -1)  # [n, H * v]
        return self.shard.all_reduce(self.o_proj(out))
