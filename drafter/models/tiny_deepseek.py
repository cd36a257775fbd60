"""Tiny random DeepSeek-V3 checkpoints in the released layout (no hub exists here).

    write_tiny_deepseek(out_dir)  ->  out_dir/head: config.json with DeepSeek-V3's keys, FP8 block-
                                      quantised MTP layer model.layers.{num_hidden_layers + i}.*,
                                      top-level model.embed_tokens / lm_head, sharded with an index;
                                      out_dir/target: a tiny Llama target with the same embedding and
                                      lm_head (what a propose call's hidden states would come from)
Weights are scaled so that logits have clear winners (parity tests compare argmaxes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from drafter.models.fp8 import quantize
from drafter.models.tiny import RandomInit, TinySizes, write_target


@dataclass(frozen=True)
class TinyDeepseekSizes:
    hidden_size: int = 64
    num_heads: int = 4
    q_lora_rank: int | None = 48
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    vocab_size: int = 512
    num_hidden_layers: int = 4  # the target's depth: the MTP layer is model.layers.4
    num_mtp_layers: int = 1
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_group: int = 4
    topk_group: int = 2
    moe_intermediate_size: int = 32
    n_shared_experts: int = 1
    intermediate_size: int = 128  # dense layers (below first_k_dense_replace)
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # yarn as released (factor 40 over 4k), scaled down; mscale_all_dim != mscale exercises both factors
    rope_scaling: dict = field(default_factory=lambda: {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.707})
    fp8_block: tuple[int, int] | None = (128, 128)  # None writes an unquantised (bf16-style) checkpoint


def deepseek_config(s: TinyDeepseekSizes) -> dict:
    """config.json with the released DeepSeek-V3 keys, at tiny sizes."""
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
        "moe_intermediate_size": s.moe_intermediate_size, "num_hidden_layers": s.num_hidden_layers,
        "num_nextn_predict_layers": s.num_mtp_layers, "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_heads, "n_shared_experts": s.n_shared_experts,
        "n_routed_experts": s.n_routed_experts, "num_experts_per_tok": s.num_experts_per_tok,
        "n_group": s.n_group, "topk_group": s.topk_group, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": s.routed_scaling_factor,
        "first_k_dense_replace": s.first_k_dense_replace, "moe_layer_freq": 1,
        "q_lora_rank": s.q_lora_rank, "kv_lora_rank": s.kv_lora_rank, "qk_nope_head_dim": s.qk_nope_head_dim,
        "qk_rope_head_dim": s.qk_rope_head_dim, "v_head_dim": s.v_head_dim, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": s.rms_norm_eps, "rope_theta": s.rope_theta,
        "rope_scaling": dict(s.rope_scaling) if s.rope_scaling else None, "attention_bias": False,
        "tie_word_embeddings": False, "vocab_size": s.vocab_size, "torch_dtype": "float32",
        "bos_token_id": 0, "eos_token_id": 1,
    }
    if s.fp8_block is not None:
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": list(s.fp8_block)}
    return cfg


class _Writer:
    """Collects one MTP layer's tensors; quantisable linears go through FP8 block quantisation."""

    def __init__(self, init: RandomInit, s: TinyDeepseekSizes, prefix: str):
        self.init, self.s, self.prefix, self.w = init, s, prefix, {}

    def linear(self, name: str, out_f: int, in_f: int, gain: float = 1.0, quantised: bool = True) -> None:
        weight = self.init.linear(out_f, in_f, gain)
        if quantised and self.s.fp8_block is not None:
            q, scale = quantize(weight, self.s.fp8_block)
            self.w[f"{self.prefix}{name}.weight"] = q
            self.w[f"{self.prefix}{name}.weight_scale_inv"] = scale
        else:
            self.w[f"{self.prefix}{name}.weight"] = weight

    def norm(self, name: str, n: int) -> None:
        self.w[f"{self.prefix}{name}.weight"] = self.init.norm(n)

    def mlp(self, name: str, inner: int) -> None:
        h = self.s.hidden_size
        self.linear(f"{name}.gate_proj", inner, h)
        self.linear(f"{name}.up_proj", inner, h)
        self.linear(f"{name}.down_proj", h, inner)


def _attention(wr: _Writer, s: TinyDeepseekSizes) -> None:
    h, qk = s.hidden_size, s.qk_nope_head_dim + s.qk_rope_head_dim
    if s.q_lora_rank:
        wr.linear("self_attn.q_a_proj", s.q_lora_rank, h, 2.0)
        wr.norm("self_attn.q_a_layernorm", s.q_lora_rank)
        wr.linear("self_attn.q_b_proj", s.num_heads * qk, s.q_lora_rank, 2.0)
    else:
        wr.linear("self_attn.q_proj", s.num_heads * qk, h, 2.0)
    wr.linear("self_attn.kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope_head_dim, h, 2.0)
    wr.norm("self_attn.kv_a_layernorm", s.kv_lora_rank)
    wr.linear("self_attn.kv_b_proj", s.num_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank, 2.0)
    wr.linear("self_attn.o_proj", h, s.num_heads * s.v_head_dim)


def _mtp_layer(init: RandomInit, s: TinyDeepseekSizes, index: int, embed, lm_head) -> dict:
    h = s.hidden_size
    wr = _Writer(init, s, f"model.layers.{s.num_hidden_layers + index}.")
    wr.w[f"{wr.prefix}embed_tokens.weight"] = embed.clone()
    wr.w[f"{wr.prefix}shared_head.head.weight"] = lm_head.clone()
    for name in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "shared_head.norm"):
        wr.norm(name, h)
    wr.linear("eh_proj", h, 2 * h, quantised=False)
    _attention(wr, s)
    if s.num_hidden_layers + index >= s.first_k_dense_replace:
        wr.w[f"{wr.prefix}mlp.gate.weight"] = init.linear(s.n_routed_experts, h, 2.0)
        wr.w[f"{wr.prefix}mlp.gate.e_score_correction_bias"] = init.small(s.n_routed_experts, 0.1)
        for e in range(s.n_routed_experts):
            wr.mlp(f"mlp.experts.{e}", s.moe_intermediate_size)
        if s.n_shared_experts:
            wr.mlp("mlp.shared_experts", s.moe_intermediate_size * s.n_shared_experts)
    else:
        wr.mlp("mlp", s.intermediate_size)
    return wr.w


def _save_sharded(out: Path, config: dict, shards: list[dict]) -> None:
    """Several safetensors files plus model.safetensors.index.json, as released checkpoints ship."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weight_map = {}
    for i, tensors in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / name))
        weight_map.update({k: name for k in tensors})
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _target_sizes(s: TinyDeepseekSizes) -> TinySizes:
    return TinySizes(hidden_size=s.hidden_size, vocab_size=s.vocab_size, num_layers=s.num_hidden_layers)


def write_tiny_deepseek(out_dir: str | Path, seed: int = 0, sizes: TinyDeepseekSizes | None = None) -> str:
    """Write out_dir/target and out_dir/head; return the engine method ("deepseek_mtp")."""
    s = sizes or TinyDeepseekSizes()
    out = Path(out_dir)
    write_target(out / "target", _target_sizes(s), seed)
    from safetensors.torch import load_file

    target = load_file(str(out / "target" / "model.safetensors"))
    embed, lm_head = target["model.embed_tokens.weight"], target["lm_head.weight"]
    init = RandomInit(seed + 1)
    layers = {}
    for i in range(s.num_mtp_layers):
        layers.update(_mtp_layer(init, s, i, embed, lm_head))
    top = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head, "model.norm.weight": init.norm(s.hidden_size)}
    _save_sharded(out / "head", deepseek_config(s), [top, layers])
    return "deepseek_mtp"
