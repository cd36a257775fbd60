"""Rotary position embeddings: read from a head's config once, computed here for every backend.

`resolve_rope` turns the rope keys of a config (either layout, see drafter.models.spec) into a
frozen `Rope`; `Rope.inv_freq()` is the one computation of the inverse frequencies, and
`Rope.cos_sin(positions, dtype)` the one computation of the cos / sin values the reference path
rotates with.  The Triton kernels take the same inverse frequencies plus the two scalars of
`RopeTables` and repeat the per-element formula:

    angle = (position / position_divisor) * inv_freq[j]
    cos   = round_to_dtype(cos(angle) * magnitude),  sin likewise

which is what vLLM 0.32 stores in its rotary cache for each type (its cache is built in float32
and cast to the model dtype; the rounding to the activation dtype above mirrors that cast).
Dimensions past `rotary_dim` (partial_rotary_factor < 1) pass through unrotated.  Rotation is
neox style (first half / second half of the rotated dimensions), as vLLM's Llama layers use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "ntk", "llama3", "yarn", "longrope")


class RopeRefused(ValueError):
    """A rope key whose value the engine does not model (the caller adds the file name)."""

    def __init__(self, key: str, value, reason: str):
        super().__init__(f"{key} = {value!r}: {reason}")
        self.key, self.value, self.reason = key, value, reason


@dataclass(frozen=True)
class Rope:
    """One layer's rotary embedding, every number resolved (no defaults left to apply)."""
    head_dim: int
    rotary_dim: int  # dimensions rotated, even, <= head_dim; the rest pass through
    theta: float
    rope_type: str = "default"
    factor: float = 1.0  # linear / dynamic / ntk / llama3 / yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3 / yarn
    dynamic_base_ratio: float = 1.0  # dynamic: the base is theta * ratio ** (rotary_dim / (rotary_dim - 2))
    mixed_b: float | None = None  # ntk
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    magnitude: float = 1.0  # yarn's attention factor / longrope's mscale: multiplies cos and sin
    rescale_factors: tuple[float, ...] = field(default=())  # longrope: the short or long factors in use

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise RopeRefused("rope_type", self.rope_type, f"not one of {ROPE_TYPES}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise RopeRefused("partial_rotary_factor", self.rotary_dim / self.head_dim,
                              f"rotates {self.rotary_dim} of head_dim {self.head_dim} dimensions (needs an even "
                              "count >= 2 and <= head_dim)")

    @classmethod
    def plain(cls, theta: float, head_dim: int) -> "Rope":
        """Unscaled rope over the whole head (a config with only rope_theta)."""
        return cls(head_dim=head_dim, rotary_dim=head_dim, theta=float(theta))

    @property
    def position_divisor(self) -> float:
        """Linear scaling divides the position (vLLM builds its table from arange / factor)."""
        return self.factor if self.rope_type == "linear" else 1.0

    def inv_freq(self) -> torch.Tensor:  # [rotary_dim // 2] float32, on the CPU
        """The inverse frequencies of every rotated pair, in the arithmetic order vLLM 0.32 uses."""
        return _INV_FREQ[self.rope_type](self)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] int -> (cos, sin), each [n, rotary_dim // 2] float32 holding values of `dtype`."""
        inv_freq = _device_inv_freq(self, positions.device)
        pos = positions.to(torch.float32)
        if self.rope_type == "linear":
            pos = pos / self.factor
        angles = pos[:, None] * inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        if self.magnitude != 1.0:
            cos, sin = cos * self.magnitude, sin * self.magnitude
        return cos.to(dtype).to(torch.float32), sin.to(dtype).to(torch.float32)

    def tables(self, device: torch.device) -> "RopeTables":
        return RopeTables(_device_inv_freq(self, device), self.position_divisor, self.magnitude, self.rotary_dim)


@dataclass(frozen=True)
class RopeTables:
    """What the Triton rotary kernel reads: the inverse frequencies on its device and two scalars."""
    inv_freq: torch.Tensor  # [rotary_dim // 2] float32
    position_divisor: float
    magnitude: float
    rotary_dim: int


_DEVICE_CACHE: dict[tuple[Rope, str], torch.Tensor] = {}


def _device_inv_freq(rope: Rope, device: torch.device) -> torch.Tensor:
    """inv_freq computed once on the CPU and kept per device (the same bits everywhere)."""
    key = (rope, str(device))
    if key not in _DEVICE_CACHE:
        _DEVICE_CACHE[key] = rope.inv_freq().to(device)
    return _DEVICE_CACHE[key]


def apply_rope(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens]
    rope: Rope | float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], x's dtype
    """Neox-style rotation of the first rotary_dim dimensions (a float: plain rope of that theta)."""
    if not isinstance(rope, Rope):
        rope = Rope.plain(rope, x.shape[-1])
    cos, sin = rope.cos_sin(positions, x.dtype)
    cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    x1, x2 = xf[..., :rope.rotary_dim].chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., rope.rotary_dim:]), dim=-1)
    return rotated.to(x.dtype)


# ---------------------------------------------------------------------------- inverse frequencies

def _exponents(rope: Rope) -> torch.Tensor:  # [rotary_dim // 2]: 2i / rotary_dim
    return torch.arange(0, rope.rotary_dim, 2, dtype=torch.float32) / rope.rotary_dim


def _plain(base: float, rope: Rope) -> torch.Tensor:
    return 1.0 / (base ** _exponents(rope))


def _default(rope: Rope) -> torch.Tensor:
    return _plain(rope.theta, rope)


def _dynamic(rope: Rope) -> torch.Tensor:
    """A static NTK base, fixed when the table is built (vLLM does not rescale per sequence)."""
    return _plain(rope.theta * rope.dynamic_base_ratio ** (rope.rotary_dim / (rope.rotary_dim - 2)), rope)


def _ntk(rope: Rope) -> torch.Tensor:
    if rope.mixed_b is None:
        return _plain(rope.theta * rope.factor, rope) / rope.factor ** (2 / rope.rotary_dim)
    half = rope.rotary_dim // 2
    slope = torch.tensor(rope.factor).log() / half ** rope.mixed_b
    return _plain(rope.theta, rope) / (slope * torch.arange(1, half + 1).float() ** rope.mixed_b).exp()


def _llama3(rope: Rope) -> torch.Tensor:
    """Long wavelengths divided by factor, short ones kept, a smooth blend in between."""
    inv = _plain(rope.theta, rope)
    old = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    lo, hi = rope.low_freq_factor, rope.high_freq_factor
    blend = (old / wavelen - lo) / (hi - lo) if lo != hi else 0
    blended = (1 - blend) * inv / rope.factor + blend * inv
    return torch.where(wavelen < old / hi, inv, torch.where(wavelen > old / lo, inv / rope.factor, blended))


def _yarn_dim(rotations: float, rope: Rope) -> float:
    """The rotated-pair index at which a wavelength fits `rotations` times into the original context."""
    old = rope.original_max_position_embeddings
    return (rope.rotary_dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))


def _yarn(rope: Rope) -> torch.Tensor:
    """Interpolated (divided by factor) below the ramp, extrapolated (kept) above it."""
    powers = rope.theta ** _exponents(rope)
    kept, scaled = 1.0 / powers, 1.0 / (rope.factor * powers)
    low, high = _yarn_dim(rope.beta_fast, rope), _yarn_dim(rope.beta_slow, rope)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope.rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope.rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return scaled * (1 - keep) + kept * keep


def _longrope(rope: Rope) -> torch.Tensor:
    factors = torch.tensor(rope.rescale_factors, dtype=torch.float32)
    return 1.0 / (factors * (rope.theta ** _exponents(rope)))


_INV_FREQ = {"default": _default, "linear": _default, "dynamic": _dynamic, "ntk": _ntk, "llama3": _llama3,
             "yarn": _yarn, "longrope": _longrope}


# ---------------------------------------------------------------------------- resolving a config

def yarn_magnitude(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _number(params: dict, key: str, *, default=None, kind=float):
    """params[key] as a number; RopeRefused naming the key when it is missing (and has no default) or not one."""
    value = params.get(key, default)
    if value is None:
        raise RopeRefused(key, None, f"required by rope_type {params.get('rope_type')!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RopeRefused(key, value, "not a number")
    return kind(value)


# keys each rope type reads (besides rope_type / rope_theta / partial_rotary_factor / rope_dim); a key
# outside its type's set, or a value these functions cannot honour, is refused by name
_TYPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "alpha", "max_trained_positions"},
    "ntk": {"factor", "mixed_b"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"},
    "longrope": {"short_factor", "long_factor", "original_max_position_embeddings", "short_mscale", "long_mscale",
                 "factor", "attention_factor"},
}
# keys transformers keeps next to the rope parameters that do not change the rotation vLLM applies
_INERT_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "rope_dim"}


@dataclass(frozen=True)
class RopeInputs:
    """The rope parameters as vLLM 0.32 sees them once its config classes are done (see spec.py)."""
    params: dict  # rope_type, rope_theta, partial_rotary_factor, original_max_position_embeddings, ... filled in
    head_dim: int
    max_position_embeddings: int  # as vLLM's draft layer sees it (EAGLE heads: raised to max_model_len)
    max_model_len: int | None  # the engine's (longrope picks its factors by it); None = not known here


def resolve_rope(inputs: RopeInputs) -> Rope:
    """The Rope vLLM 0.32's get_rope builds from these parameters, or RopeRefused naming the key."""
    p = inputs.params
    rope_type = p.get("rope_type", "default")
    if rope_type not in _TYPE_KEYS:
        raise RopeRefused("rope_type", rope_type, f"not a rope type the engine models {ROPE_TYPES}")
    for key in ("mrope_section", "use_fope", "mrope_interleaved"):
        if p.get(key):
            raise RopeRefused(key, p[key], "multimodal / Fourier rope is not modelled")
    unknown = sorted(set(p) - _TYPE_KEYS[rope_type] - _INERT_KEYS)
    if unknown:
        raise RopeRefused(unknown[0], p[unknown[0]], f"not a parameter of rope_type {rope_type!r} in vLLM 0.32")
    theta = _number(p, "rope_theta")
    rotary_dim = _rotary_dim(p, inputs.head_dim)
    base = dict(head_dim=inputs.head_dim, rotary_dim=rotary_dim, theta=theta, rope_type=rope_type)
    if rope_type == "default":
        return Rope(**base)
    return _RESOLVERS[rope_type](p, base, inputs)


def _rotary_dim(p: dict, head_dim: int) -> int:
    if p.get("rope_dim"):
        return int(_number(p, "rope_dim", kind=int))
    fraction = _number(p, "partial_rotary_factor", default=1.0)
    if not 0.0 < fraction <= 1.0:
        raise RopeRefused("partial_rotary_factor", fraction, "must be in (0, 1]")
    return int(head_dim * fraction)


def _linear(p, base, inputs) -> Rope:
    return Rope(**base, factor=_number(p, "factor"))


def _dynamic_rope(p, base, inputs) -> Rope:
    factor = _number(p, "factor")  # transformers requires it even where alpha takes over
    if p.get("alpha") is not None:
        return Rope(**base, dynamic_base_ratio=_number(p, "alpha"))
    limit = inputs.max_position_embeddings
    trained = _number(p, "max_trained_positions", default=limit, kind=int)
    ratio = (factor * limit / trained) - (factor - 1)
    return Rope(**base, factor=factor, dynamic_base_ratio=ratio)


def _ntk_rope(p, base, inputs) -> Rope:
    mixed = p.get("mixed_b")
    return Rope(**base, factor=_number(p, "factor"), mixed_b=None if mixed is None else _number(p, "mixed_b"))


def _llama3_rope(p, base, inputs) -> Rope:
    return Rope(**base, factor=_number(p, "factor"), low_freq_factor=_number(p, "low_freq_factor"),
                high_freq_factor=_number(p, "high_freq_factor"),
                original_max_position_embeddings=_number(p, "original_max_position_embeddings", kind=int))


def _yarn_rope(p, base, inputs) -> Rope:
    factor = _number(p, "factor")
    if p.get("attention_factor") is not None:
        magnitude = _number(p, "attention_factor")
    elif p.get("mscale") and p.get("mscale_all_dim"):
        magnitude = float(yarn_magnitude(factor, _number(p, "mscale"))
                          / yarn_magnitude(factor, _number(p, "mscale_all_dim")))
    else:
        magnitude = float(yarn_magnitude(factor))
    truncate = p.get("truncate", True)
    if not isinstance(truncate, bool):
        raise RopeRefused("truncate", truncate, "not a bool")
    return Rope(**base, factor=factor, original_max_position_embeddings=_number(
        p, "original_max_position_embeddings", kind=int), beta_fast=_number(p, "beta_fast", default=32),
        beta_slow=_number(p, "beta_slow", default=1), truncate=truncate, magnitude=magnitude)


def _longrope_rope(p, base, inputs) -> Rope:
    """Short factors while max_model_len fits the original context, long ones beyond (fixed per engine)."""
    if inputs.max_model_len is None:
        raise RopeRefused("rope_type", "longrope", "needs the engine's max_model_len to pick short or long factors")
    old = _number(p, "original_max_position_embeddings", kind=int)
    long = inputs.max_model_len > old
    for key in ("short_factor", "long_factor"):  # vLLM builds both tables
        factors = p.get(key)
        if not isinstance(factors, (list, tuple)) or len(factors) != base["rotary_dim"] // 2 or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) for f in factors):
            raise RopeRefused(key, factors, f"needs {base['rotary_dim'] // 2} numbers (rotary_dim / 2)")
    factors = p["long_factor" if long else "short_factor"]
    scale = inputs.max_position_embeddings / old
    default_mscale = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(old))
    mkey = "long_mscale" if long else "short_mscale"
    magnitude = default_mscale if p.get(mkey) is None else _number(p, mkey)
    return Rope(**base, original_max_position_embeddings=old, magnitude=magnitude,
                rescale_factors=tuple(float(f) for f in factors))


_RESOLVERS = {"linear": _linear, "dynamic": _dynamic_rope, "ntk": _ntk_rope, "llama3": _llama3_rope,
              "yarn": _yarn_rope, "longrope": _longrope_rope}
