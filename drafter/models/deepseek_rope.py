"""The rotary embedding of DeepSeek's MLA rope part: interleaved (GPT-J) pairs, DeepSeek-style YaRN.

DeepSeek-V3 rotates only the last qk_rope_head_dim features of each query head and the one
shared k_pe.  Pairs are adjacent features (2i, 2i+1), not halves.  With yarn scaling, the
inverse frequencies blend interpolated (divided by `factor`) and original ones over a ramp
between the correction dimensions of beta_fast / beta_slow rotations, and cos/sin carry the
magnitude factor MLARope.cos_sin_mscale.  The table is built in float32 and cast to the
activations' dtype before use, as vLLM 0.32's cos/sin cache is.  (drafter/models/rope.py, for
Llama-family rope types, did not exist when this was written; this module is MLA's own.)
"""

from __future__ import annotations

import math

import torch

from drafter.models.deepseek_config import MLARope


def _correction_dim(rotations: float, dim: int, theta: float, max_position: int) -> float:
    """The feature index whose wavelength completes `rotations` turns over max_position tokens."""
    return dim * math.log(max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def inverse_frequencies(rope: MLARope, dim: int) -> torch.Tensor:  # [dim // 2] float32
    base = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1.0 / base
    if not rope.yarn:
        return extrapolated
    interpolated = 1.0 / (rope.factor * base)
    low = max(math.floor(_correction_dim(rope.beta_fast, dim, rope.theta, rope.original_max_position)), 0)
    high = min(math.ceil(_correction_dim(rope.beta_slow, dim, rope.theta, rope.original_max_position)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp
    return interpolated * (1 - keep_original) + extrapolated * keep_original


def cos_sin(
    inv_freq: torch.Tensor,  # [dim // 2] float32, on positions' device
    rope: MLARope,
    positions: torch.Tensor,  # [num_tokens]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin at each position, [num_tokens, dim // 2] float32 each, mscale applied."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    scale = rope.cos_sin_mscale if rope.yarn else 1.0
    return angles.cos() * scale, angles.sin() * scale


def apply_interleaved_rope(
    x: torch.Tensor,  # [num_tokens, num_heads, dim]
    cos: torch.Tensor,  # [num_tokens, dim // 2]
    sin: torch.Tensor,  # [num_tokens, dim // 2]
) -> torch.Tensor:  # [num_tokens, num_heads, dim], x's dtype
    """Rotate pairs (x[2i], x[2i+1]) by the angle of frequency i, in x's dtype."""
    cos = cos.to(x.dtype).repeat_interleave(2, dim=-1)[:, None, :]
    sin = sin.to(x.dtype).repeat_interleave(2, dim=-1)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((-odd, even), dim=-1).flatten(-2)
    return x * cos + rotated * sin
