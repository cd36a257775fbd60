"""A DeepSeek-V3 checkpoint's config.json, parsed once into frozen shapes for its MTP layers.

Keys are read under their released names (n_routed_experts, num_experts_per_tok, n_group,
topk_group, routed_scaling_factor, scoring_func, topk_method, q_lora_rank, kv_lora_rank,
qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_scaling, quantization_config).  Anything
that would change a logit and that this package does not compute exactly as vLLM 0.32 does is
refused here with an error naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class UnsupportedConfig(ValueError):
    """A config.json key whose value this package does not implement."""

    def __init__(self, key: str, why: str):
        super().__init__(f"deepseek config: {key}: {why}")
        self.key, self.why = key, why


def value_at(cfg: dict, dotted: str):
    """cfg's value under a dotted key ("rope_scaling.type"), None where absent."""
    for part in dotted.split("."):
        if not isinstance(cfg, dict):
            return None
        cfg = cfg.get(part)
    return cfg


@dataclass(frozen=True)
class MLARope:
    """Rotary embedding of the MLA rope part: GPT-J (interleaved) pairs, optional DeepSeek yarn."""

    theta: float
    factor: float = 1.0  # 1.0 = no yarn scaling
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @property
    def yarn(self) -> bool:
        return self.factor > 1.0

    @property
    def attention_mscale(self) -> float:
        """Factor on the softmax scale: yarn_mscale(factor, mscale_all_dim) squared."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    @property
    def cos_sin_mscale(self) -> float:
        """Factor on cos/sin: yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)."""
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)

    @property
    def max_position(self) -> int:
        """Positions the rotary table covers (original length x factor)."""
        return int(self.original_max_position * self.factor)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MLAShape:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: a plain q_proj (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope: MLARope

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Per-token entry of the compressed KV cache: normed latent c_kv then rotated k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.rope.attention_mscale


@dataclass(frozen=True)
class MoEShape:
    hidden_size: int
    num_experts: int  # n_routed_experts
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size, per expert
    num_shared_experts: int  # 0 = none; else one MLP of num_shared * intermediate_size
    num_groups: int  # n_group
    topk_groups: int  # topk_group
    normalize_topk: bool  # norm_topk_prob
    routed_scaling_factor: float
    scoring_func: str  # sigmoid | softmax
    correction_bias: bool  # topk_method == "noaux_tc": e_score_correction_bias picks experts

    @property
    def grouped(self) -> bool:
        """vLLM limits selection to top groups only when the experts split evenly into >1 per group."""
        return self.num_experts > self.num_groups and self.num_experts % self.num_groups == 0


@dataclass(frozen=True)
class DeepseekLayerShape:
    """One MTP layer: MLA attention, then a MoE (or a dense MLP where the layer index says so)."""

    hidden_size: int
    rms_norm_eps: float
    attn: MLAShape
    moe: MoEShape | None
    intermediate_size: int  # the dense MLP's, used when moe is None
    sliding_window: None = None  # MLA layers attend to the full context (KV group 0)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int]:
        """The layer's compressed cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]."""
        return num_blocks, block_size, self.attn.cache_width


@dataclass(frozen=True)
class DeepseekConfig:
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int  # the target's depth: MTP layer i is model.layers.{num_hidden_layers + i}
    layers: tuple[DeepseekLayerShape, ...]  # one per MTP layer
    fp8_block: tuple[int, int] | None  # (rows, cols) of a weight_scale_inv block; None = unquantised
    rms_norm_eps: float
    tie_word_embeddings: bool = False


def _rope(cfg: dict) -> MLARope:
    theta = float(cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return MLARope(theta=theta)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return MLARope(theta=float(scaling.get("rope_theta", theta)))
    if kind not in ("yarn", "deepseek_yarn"):
        raise UnsupportedConfig("rope_scaling.type", f"{kind!r} (only yarn is implemented for MLA)")
    if scaling.get("attention_factor") == 1.0:
        raise UnsupportedConfig("rope_scaling.attention_factor", "1.0 selects deepseek_llama_scaling, not implemented")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise UnsupportedConfig(f"rope_scaling.{key}", "yarn needs it")
    return MLARope(
        theta=float(scaling.get("rope_theta", theta)),
        factor=float(scaling["factor"]),
        original_max_position=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast", 32)),
        beta_slow=float(scaling.get("beta_slow", 1)),
        mscale=float(scaling.get("mscale", 1)),
        mscale_all_dim=float(scaling.get("mscale_all_dim", 0)),
    )


def _fp8_block(cfg: dict) -> tuple[int, int] | None:
    q = cfg.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        raise UnsupportedConfig("quantization_config.quant_method", f"{q.get('quant_method')!r} (only fp8)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedConfig("quantization_config.fmt", f"{q.get('fmt')!r} (only e4m3)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedConfig("quantization_config.activation_scheme", f"{q.get('activation_scheme')!r}")
    block = q.get("weight_block_size")
    if not block or len(block) != 2 or min(block) <= 0:
        raise UnsupportedConfig("quantization_config.weight_block_size", f"{block!r} (need [rows, cols])")
    return int(block[0]), int(block[1])


def _mla(cfg: dict, eps: float) -> MLAShape:
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not cfg.get(key):
            raise UnsupportedConfig(key, "MLA needs a positive value")
    if cfg["qk_rope_head_dim"] % 2:
        raise UnsupportedConfig("qk_rope_head_dim", "must be even")
    return MLAShape(
        hidden_size=cfg["hidden_size"], num_heads=cfg["num_attention_heads"], q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"], rms_norm_eps=eps, rope=_rope(cfg))


def _moe(cfg: dict) -> MoEShape:
    scoring = cfg.get("scoring_func", "softmax")
    if scoring not in ("sigmoid", "softmax"):
        raise UnsupportedConfig("scoring_func", f"{scoring!r} (sigmoid or softmax)")
    experts, groups = cfg["n_routed_experts"], int(cfg.get("n_group") or 1)
    top_k, topk_groups = cfg["num_experts_per_tok"], int(cfg.get("topk_group") or 1)
    if not 0 < top_k <= experts:
        raise UnsupportedConfig("num_experts_per_tok", f"{top_k} with {experts} experts")
    shape = MoEShape(
        hidden_size=cfg["hidden_size"], num_experts=experts, top_k=top_k,
        intermediate_size=cfg["moe_intermediate_size"], num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        num_groups=groups, topk_groups=topk_groups, normalize_topk=bool(cfg.get("norm_topk_prob", False)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)), scoring_func=scoring,
        correction_bias=cfg.get("topk_method") == "noaux_tc")
    if shape.grouped and not (0 < topk_groups <= groups and top_k <= topk_groups * experts // groups):
        raise UnsupportedConfig("topk_group", f"{topk_groups} groups of {experts // groups} cannot hold top-{top_k}")
    if not shape.grouped and not shape.correction_bias and scoring == "sigmoid":
        raise UnsupportedConfig("n_group", f"{groups} groups of {experts} experts: vLLM 0.32 would route these "
                                "sigmoid scores through its softmax top-k")
    if shape.grouped and shape.correction_bias and experts // groups < 2:
        raise UnsupportedConfig("n_group", "bias-corrected group scores sum each group's top two experts")
    return shape


def _is_moe_layer(cfg: dict, index: int) -> bool:
    """vLLM's rule: a MoE layer once past first_k_dense_replace, every moe_layer_freq layers."""
    return (cfg.get("n_routed_experts") is not None and index >= int(cfg.get("first_k_dense_replace", 0))
            and index % int(cfg.get("moe_layer_freq", 1)) == 0)


def _refuse_unimplemented(cfg: dict) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfig("hidden_act", f"{cfg['hidden_act']!r} (only silu)")
    if "index_topk" in cfg:
        raise UnsupportedConfig("index_topk", "DeepSeek-V3.2 sparse attention (indexer) is not implemented")
    if cfg.get("llama_4_scaling"):
        raise UnsupportedConfig("llama_4_scaling", "not implemented")
    if cfg.get("attention_bias"):
        raise UnsupportedConfig("attention_bias", "MLA projections carry no bias")
    if cfg.get("model_type", "deepseek_v3") == "deepseek":
        raise UnsupportedConfig("model_type", "'deepseek' (V1) uses multi-head attention, not MLA")


def parse_deepseek(cfg: dict) -> DeepseekConfig:
    """Parse a DeepSeek-V2/V3 config.json (the target's, which describes its MTP layers)."""
    _refuse_unimplemented(cfg)
    num_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    if num_mtp <= 0:
        raise UnsupportedConfig("num_nextn_predict_layers", "a deepseek_mtp head needs >= 1")
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    first = cfg["num_hidden_layers"]
    attn = _mla(cfg, eps)
    layers = tuple(
        DeepseekLayerShape(hidden_size=cfg["hidden_size"], rms_norm_eps=eps, attn=attn,
                           moe=_moe(cfg) if _is_moe_layer(cfg, first + i) else None,
                           intermediate_size=int(cfg.get("intermediate_size", 0)))
        for i in range(num_mtp))
    return DeepseekConfig(hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"], num_hidden_layers=first,
                          layers=layers, fp8_block=_fp8_block(cfg), rms_norm_eps=eps,
                          tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))


# The released DeepSeek-V3 config.json's keys that shape its MTP layer (for benchmarks at the real
# shape and for tests; a checkpoint's own config.json is what loading reads).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "vocab_size": 129280, "tie_word_embeddings": False,
    "max_position_embeddings": 163840,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
