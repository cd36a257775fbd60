"""Write tiny random checkpoints in the layouts real ones use (no hub exists here).

    write_tiny(method, out_dir)  ->  out_dir/target (HF Llama) and out_dir/head (the draft head)

Weights are scaled so that logits have clear winners: exact-parity tests compare argmaxes,
which should not hinge on float rounding.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from drafter.models.spec import MTP_ARCHITECTURE


@dataclass(frozen=True)
class TinySizes:
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32  # vLLM's CPU attention needs head_dim in {32, 64, ...}; q width may differ from hidden
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    aux_layer_ids: tuple[int, ...] = (1, 2, 3)
    draft_vocab_size: int = 192  # EAGLE-3 heads use a reduced vocabulary with d2t
    sliding_window: int = 24
    head_layer_types: tuple[str, ...] = ("full_attention",)
    num_mtp_layers: int = 1
    # the head's own config (the target keeps rope_theta alone): how its rope is written
    rope: tuple[tuple[str, object], ...] = ()  # rope parameters besides rope_theta, e.g. (("rope_type", "yarn"), ...)
    rope_layout: str = "legacy"  # legacy: rope_theta + rope_scaling | params: transformers-5 rope_parameters
    head_rope_theta: float | None = None  # None = rope_theta
    partial_rotary_factor: float | None = None
    attention_bias: bool = False  # q/k/v and o_proj biases (EAGLE-3 layer 0: q/k/v and o)
    mlp_bias: bool = False
    eagle3_layout: str = "speculators"  # speculators | plain (SafeAILab LlamaForCausalLMEagle3, midlayer.*)

    def __post_init__(self):
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"rope_layout must be one of {ROPE_LAYOUTS}, got {self.rope_layout!r}")
        if self.eagle3_layout not in EAGLE3_LAYOUTS:
            raise ValueError(f"eagle3_layout must be one of {EAGLE3_LAYOUTS}, got {self.eagle3_layout!r}")


ROPE_LAYOUTS = ("legacy", "params")
EAGLE3_LAYOUTS = ("speculators", "plain")
# named rope settings for make-tiny --rope (small original contexts, so scaling bites below position 128)
ROPE_PRESETS: dict[str, tuple[float, tuple[tuple[str, object], ...]]] = {
    "default": (10000.0, ()),
    "qwen3": (1000000.0, ()),
    "llama3": (500000.0, (("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0),
                          ("high_freq_factor", 4.0), ("original_max_position_embeddings", 32))),
    "yarn": (10000.0, (("rope_type", "yarn"), ("factor", 4.0), ("original_max_position_embeddings", 32))),
    "linear": (10000.0, (("rope_type", "linear"), ("factor", 4.0))),
    "dynamic": (10000.0, (("rope_type", "dynamic"), ("factor", 4.0), ("max_trained_positions", 64))),
    "ntk": (10000.0, (("rope_type", "ntk"), ("factor", 4.0))),
}


def _rope_keys(s: TinySizes) -> dict:
    """The head's rope keys in the chosen layout."""
    theta = s.rope_theta if s.head_rope_theta is None else s.head_rope_theta
    params = dict(s.rope)
    if s.rope_layout == "params":
        return {"rope_parameters": {"rope_type": "default", **params, "rope_theta": theta}}
    return {"rope_theta": theta, "rope_scaling": params or None}


def _head_config(s: TinySizes, num_layers: int, layer_types=None) -> dict:
    """A head's Llama layer config: the target's keys with the head's rope, biases and partial rotary."""
    cfg = _llama_config(s, num_layers, layer_types)
    del cfg["rope_theta"]
    cfg.update(_rope_keys(s))
    if s.partial_rotary_factor is not None:
        cfg["partial_rotary_factor"] = s.partial_rotary_factor
    cfg["attention_bias"] = s.attention_bias
    cfg["mlp_bias"] = s.mlp_bias
    return cfg


def _llama_config(s: TinySizes, num_layers: int, layer_types=None) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab_size,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "max_position_embeddings": s.max_position_embeddings,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if layer_types and any(t == "sliding_attention" for t in layer_types):
        cfg["layer_types"] = list(layer_types)
        cfg["sliding_window"] = s.sliding_window
    return cfg


class RandomInit:
    """Seeded random tensors for tiny checkpoints (one generator: a seed fixes every weight)."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def linear(self, out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=self.g) * (gain / in_f ** 0.5)

    def norm(self, n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=self.g)

    def embedding(self, v: int, h: int) -> torch.Tensor:
        return torch.randn(v, h, generator=self.g)

    def small(self, n: int, scale: float) -> torch.Tensor:
        return scale * torch.randn(n, generator=self.g)


def _biases(init: RandomInit, s: TinySizes, prefix: str) -> dict:
    """The bias vectors a head layer with attention_bias / mlp_bias carries."""
    hd, w = s.head_dim, {}
    if s.attention_bias:
        for name, width in (("q_proj", s.num_heads * hd), ("k_proj", s.num_kv_heads * hd),
                            ("v_proj", s.num_kv_heads * hd), ("o_proj", s.hidden_size)):
            w[f"{prefix}self_attn.{name}.bias"] = 0.5 * torch.randn(width, generator=init.g)
    if s.mlp_bias:
        for name, width in (("gate_proj", s.intermediate_size), ("up_proj", s.intermediate_size),
                            ("down_proj", s.hidden_size)):
            w[f"{prefix}mlp.{name}.bias"] = 0.5 * torch.randn(width, generator=init.g)
    return w


def _layer(init: RandomInit, s: TinySizes, prefix: str, attn_in: int, input_norm: bool = True,
           biases: bool = False) -> dict:
    hd = s.head_dim
    w = {
        f"{prefix}self_attn.q_proj.weight": init.linear(s.num_heads * hd, attn_in, 2.0),
        f"{prefix}self_attn.k_proj.weight": init.linear(s.num_kv_heads * hd, attn_in, 2.0),
        f"{prefix}self_attn.v_proj.weight": init.linear(s.num_kv_heads * hd, attn_in),
        f"{prefix}self_attn.o_proj.weight": init.linear(s.hidden_size, s.num_heads * hd),
        f"{prefix}mlp.gate_proj.weight": init.linear(s.intermediate_size, s.hidden_size),
        f"{prefix}mlp.up_proj.weight": init.linear(s.intermediate_size, s.hidden_size),
        f"{prefix}mlp.down_proj.weight": init.linear(s.hidden_size, s.intermediate_size),
        f"{prefix}post_attention_layernorm.weight": init.norm(s.hidden_size),
    }
    if input_norm:
        w[f"{prefix}input_layernorm.weight"] = init.norm(s.hidden_size)
    if biases:
        w.update(_biases(init, s, prefix))
    return w


def _save(out: Path, config: dict, weights: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if weights:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))


def write_target(out: Path, s: TinySizes, seed: int) -> None:
    init = RandomInit(seed)
    w = {"model.embed_tokens.weight": init.embedding(s.vocab_size, s.hidden_size)}
    for i in range(s.num_layers):
        w.update(_layer(init, s, f"model.layers.{i}.", s.hidden_size))
    w["model.norm.weight"] = init.norm(s.hidden_size)
    w["lm_head.weight"] = init.linear(s.vocab_size, s.hidden_size, 4.0)
    _save(out, _llama_config(s, s.num_layers), w)


def write_eagle(out: Path, s: TinySizes, seed: int) -> None:
    """SafeAILab / vLLM EAGLE-1: fc over [embed; hidden], layer 0 without input_layernorm."""
    init = RandomInit(seed)
    n = len(s.head_layer_types)
    w = {"fc.weight": init.linear(s.hidden_size, 2 * s.hidden_size)}
    for i in range(n):
        w.update(_layer(init, s, f"layers.{i}.", s.hidden_size, input_norm=i > 0, biases=True))
    _save(out, _head_config(s, n, s.head_layer_types), w)


def write_eagle3(out: Path, s: TinySizes, seed: int) -> None:
    """vLLM speculators EAGLE-3: fc over the aux states, 2H-wide attention, own norm + lm_head, d2t."""
    init = RandomInit(seed)
    h, dv = s.hidden_size, s.draft_vocab_size
    w = {"fc.weight": init.linear(h, len(s.aux_layer_ids) * h)}
    w.update(_layer(init, s, "layers.0.", 2 * h, biases=True))
    w["layers.0.hidden_norm.weight"] = init.norm(h)
    for i in range(1, len(s.head_layer_types)):
        w.update(_layer(init, s, f"layers.{i}.", h, biases=True))
    w["norm.weight"] = init.norm(h)
    w["lm_head.weight"] = init.linear(dv, h, 4.0)
    # the draft vocabulary: a sorted random subset of the target's, stored as offsets
    chosen = torch.randperm(s.vocab_size, generator=init.g)[:dv].sort().values
    w["d2t"] = chosen - torch.arange(dv)
    t2d = torch.zeros(s.vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    w["t2d"] = t2d
    layer_cfg = _head_config(s, len(s.head_layer_types), s.head_layer_types)
    if s.eagle3_layout == "plain":  # SafeAILab: one Llama config, the first layer named midlayer
        _save(out, {**layer_cfg, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": dv,
                    "eagle_aux_hidden_state_layer_ids": list(s.aux_layer_ids)},
              {re.sub(r"^layers\.0\.", "midlayer.", k): v for k, v in w.items()})
        return
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": dv,
        "norm_before_residual": True,
        "target_hidden_size": h,
        "eagle_aux_hidden_state_layer_ids": list(s.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": "float32",
    }
    _save(out, config, w)


def write_mtp(out: Path, s: TinySizes, seed: int) -> None:
    """The engine's own dense MTP layout (architectures [MTP_ARCHITECTURE]) under DeepSeek-V3's
    naming: MTP layer i is model.layers.{num_hidden_layers + i}, each with its own shared_head;
    the embedding is shared from the target."""
    init = RandomInit(seed)
    h = s.hidden_size
    w = {}
    for i in range(s.num_mtp_layers):
        p = f"model.layers.{s.num_layers + i}."
        w.update(_layer(init, s, p, h))
        w[p + "enorm.weight"] = init.norm(h)
        w[p + "hnorm.weight"] = init.norm(h)
        w[p + "eh_proj.weight"] = init.linear(h, 2 * h)
        w[p + "shared_head.norm.weight"] = init.norm(h)
        w[p + "shared_head.head.weight"] = init.linear(s.vocab_size, h, 4.0)
    config = _llama_config(s, s.num_layers)
    config["architectures"] = [MTP_ARCHITECTURE]
    config["num_nextn_predict_layers"] = s.num_mtp_layers
    types = s.head_layer_types if len(s.head_layer_types) == s.num_mtp_layers else ("full_attention",) * s.num_mtp_layers
    if any(t == "sliding_attention" for t in types):
        config["mtp_layer_types"] = list(types)
        config["sliding_window"] = s.sliding_window
    _save(out, config, w)


def write_extract(out: Path, s: TinySizes, seed: int) -> None:
    config = _llama_config(s, s.num_layers)
    config["eagle_aux_hidden_state_layer_ids"] = list(s.aux_layer_ids)
    _save(out, config, {})


WRITERS = {"eagle": write_eagle, "eagle3": write_eagle3, "mtp": write_mtp, "extract_hidden_states": write_extract}
VARIANTS = {
    # method name on the CLI -> (engine method, sizes)
    "eagle": ("eagle", TinySizes()),
    "eagle3": ("eagle3", TinySizes()),
    "mtp": ("mtp", TinySizes()),
    "mtp-multi": ("mtp", TinySizes(num_mtp_layers=2, head_layer_types=("full_attention", "sliding_attention"))),
    "extract_hidden_states": ("extract_hidden_states", TinySizes()),
    "deepseek_mtp": ("deepseek_mtp", TinySizes()),  # MLA + MoE + FP8 blocks: drafter.models.tiny_deepseek
}


def head_sizes(variant: str, *, rope: str = "default", rope_layout: str = "legacy",
               eagle3_layout: str = "speculators", attention_bias: bool = False, mlp_bias: bool = False,
               head_dim: int | None = None, partial_rotary_factor: float | None = None) -> TinySizes:
    """The variant's sizes with a head configuration of make-tiny's flags (rope: a ROPE_PRESETS name)."""
    if rope not in ROPE_PRESETS:
        raise ValueError(f"unknown rope preset {rope!r}; choose from {sorted(ROPE_PRESETS)}")
    theta, params = ROPE_PRESETS[rope]
    base = VARIANTS[variant][1]
    return replace(base, rope=params, head_rope_theta=theta, rope_layout=rope_layout, eagle3_layout=eagle3_layout,
                   attention_bias=attention_bias, mlp_bias=mlp_bias, head_dim=head_dim or base.head_dim,
                   partial_rotary_factor=partial_rotary_factor)


def write_tiny(variant: str, out_dir: str | Path, seed: int = 0, sizes: TinySizes | None = None) -> str:
    """Write out_dir/target and out_dir/head; return the engine method the head needs."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny variant {variant!r}; choose from {sorted(VARIANTS)}")
    method, default_sizes = VARIANTS[variant]
    if method == "deepseek_mtp":
        return _write_deepseek(variant, out_dir, seed, sizes)
    s = sizes or default_sizes
    out = Path(out_dir)
    write_target(out / "target", s, seed)
    WRITERS[method](out / "head", s, seed + 1)
    return method


def _write_deepseek(variant: str, out_dir, seed: int, sizes: TinySizes | None) -> str:
    """DeepSeek-V3's layout has its own sizes (TinyDeepseekSizes); Llama head flags do not apply."""
    from drafter.models.tiny_deepseek import write_tiny_deepseek

    if sizes is not None and sizes not in (VARIANTS[variant][1], head_sizes(variant)):
        raise ValueError("make-tiny --method deepseek_mtp writes the released DeepSeek-V3 layout: the head "
                         "shape flags (--rope, --head-dim, biases, layouts) do not apply to it")
    return write_tiny_deepseek(out_dir, seed)
