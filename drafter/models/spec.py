"""What a checkpoint's config.json says about a model, parsed once into plain values.

Two layouts of a head's config.json are read, the way vLLM 0.32 (with transformers 5) reads them:
  plain        a Llama config (EAGLE-1, SafeAILab EAGLE-3 `LlamaForCausalLMEagle3`, MTP, targets);
               transformers' LlamaConfig fills the defaults.
  speculators  `speculators_config` + `transformer_layer_config` (vLLM's SpeculatorsConfig): the
               layer keys come from transformer_layer_config alone, EAGLE-3 keys from the top level.
Every key that changes the math is honoured exactly or refused with a HeadConfigError naming the
file, the key and the value; docs/head-configs.md lists them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from drafter.models.layers import LayerShape
from drafter.models.rope import Rope, RopeInputs, RopeRefused, resolve_rope


class HeadConfigError(ValueError):
    """A config key whose value the engine would not honour exactly."""

    def __init__(self, source: str, key: str, value, reason: str):
        super().__init__(f"{source}: {key} = {value!r}: {reason}")
        self.source, self.key, self.value = source, key, value


@dataclass(frozen=True)
class ModelSpec:
    method: str  # llama (a target) | eagle | eagle3 | mtp | extract_hidden_states
    hidden_size: int
    num_layers: int
    vocab_size: int  # the target's vocabulary
    layer_shapes: tuple[LayerShape, ...]  # one per decoder layer (sliding window per layer)
    draft_vocab_size: int  # == vocab_size unless an EAGLE-3 head maps a smaller vocab via d2t
    aux_layer_ids: tuple[int, ...] = ()  # target residual streams the head consumes (EAGLE-3, extract)
    fc_bias: bool = False  # vLLM 0.32 builds EAGLE fc layers without bias; kept for synthetic benches
    norm_before_residual: bool = False
    tie_word_embeddings: bool = False
    mtp_first_layer: int = 0
    target_hidden_size: int = 0  # EAGLE-3 heads may be narrower than their target; 0 = hidden_size
    num_fc_inputs: int = 0  # EAGLE-3: aux states the fc layer takes (0 = len(aux_layer_ids))

    @property
    def target_width(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @property
    def hidden_input_width(self) -> int:
        """Width of the target hidden states a propose call carries per token."""
        if self.method in ("eagle3", "extract_hidden_states"):
            return len(self.aux_layer_ids) * self.target_width
        return self.hidden_size  # DeepSeek names MTP layer i "model.layers.{num_target_layers + i}"

    @property
    def kv_group_of_layer(self) -> tuple[int, ...]:
        """Group 0 holds full-attention layers, group 1 sliding-window ones (if any)."""
        sliding = tuple(s.sliding_window is not None for s in self.layer_shapes)
        if all(sliding):
            return tuple(0 for _ in sliding)
        return tuple(int(is_sliding) for is_sliding in sliding)

    @property
    def num_kv_groups(self) -> int:
        return len(set(self.kv_group_of_layer))


class ConfigDict(dict):
    """A config.json's keys, remembering the file they came from (for HeadConfigError)."""
    source: str = "config.json"


def read_config(path: str | Path) -> ConfigDict:
    path = Path(path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {path.parent}")
    cfg = ConfigDict(json.loads(path.read_text()))
    cfg.source = str(path)
    return cfg


def config_source(path: str | Path) -> str:
    return str(Path(path) / "config.json")


# ---------------------------------------------------------------------------- key reading

_MISSING = object()


@dataclass(frozen=True)
class _Keys:
    """One dict of config keys, where it sits (for messages) and what a missing key means in it."""
    cfg: dict
    source: str
    prefix: str  # "" or "transformer_layer_config."
    llama_defaults: bool  # plain layout: transformers' LlamaConfig defaults; speculators: none

    def refuse(self, key: str, value, reason: str) -> HeadConfigError:
        return HeadConfigError(self.source, self.prefix + key, value, reason)

    def get(self, key: str, default=_MISSING):
        """cfg[key]; a missing key takes LlamaConfig's default in the plain layout, `default` where
        vLLM reads it with one, else it is refused (vLLM would fail on it too)."""
        if key in self.cfg:
            return self.cfg[key]
        if default is not _MISSING:
            return default
        if self.llama_defaults and key in _LLAMA_DEFAULTS:
            return _LLAMA_DEFAULTS[key]
        raise self.refuse(key, None, "missing (vLLM 0.32 reads it without a default in this layout)")

    def number(self, key: str, default=_MISSING, kind=float):
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.refuse(key, value, "not a finite number")
        return kind(value)

    def flag(self, key: str, default=False) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool) and value is not None:
            raise self.refuse(key, value, "not a bool")
        return bool(value)


# transformers 5 LlamaConfig defaults of the keys read below (plain layout)
_LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 2048,
                   "attention_bias": False, "mlp_bias": False, "rope_theta": 10000.0}
_LLAMA_MODEL_TYPES = ("llama",)


def _refuse_unmodelled(keys: _Keys) -> None:
    """Keys of a Llama layer config that change the math in ways the engine does not model."""
    model_type = keys.cfg.get("model_type", "llama")
    if model_type not in _LLAMA_MODEL_TYPES:
        raise keys.refuse("model_type", model_type, "only Llama layers are modelled (vLLM builds other "
                          "architectures' layers, e.g. Qwen3's per-head q/k norms, for it)")
    if keys.get("hidden_act") != "silu":
        raise keys.refuse("hidden_act", keys.cfg.get("hidden_act"), "vLLM's Llama MLP supports only silu")
    if keys.cfg.get("is_causal", True) is not True:
        raise keys.refuse("is_causal", keys.cfg["is_causal"], "bidirectional attention is not modelled")
    if keys.cfg.get("logit_scale", 1.0) != 1.0:
        raise keys.refuse("logit_scale", keys.cfg["logit_scale"], "scaled logits are not modelled")
    if keys.cfg.get("quantization_config"):
        raise keys.refuse("quantization_config", keys.cfg["quantization_config"], "quantized heads are not modelled")
    for key in ("rotary_emb_base", "rotary_pct", "rotary_emb_fraction"):
        if key in keys.cfg:
            raise keys.refuse(key, keys.cfg[key], "a legacy rope key; write rope_theta / partial_rotary_factor")


# ---------------------------------------------------------------------------- rope

_LAYER_TYPE_NAMES = {"full_attention", "sliding_attention", "chunked_attention", "linear_attention"}


def _rope_dict(keys: _Keys) -> tuple[str, dict]:
    """(name of the dict used, a copy of it): what ends up as rope_parameters in vLLM's config.
    Plain layout (LlamaConfig): a non-empty rope_scaling wins over rope_parameters.  Speculators
    layout (attributes set in key order): whichever of the two comes last in the file."""
    cfg = keys.cfg
    if keys.llama_defaults:
        name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    else:
        present = [k for k in cfg if k in ("rope_scaling", "rope_parameters")]
        name = present[-1] if present else "rope_parameters"
    value = cfg.get(name) or {}
    if not isinstance(value, dict):
        raise keys.refuse(name, value, "not an object")
    if value and set(value) <= _LAYER_TYPE_NAMES:
        raise keys.refuse(name, value, "per-layer-type rope parameters are not modelled")
    return name, dict(value)


def _standard_rope_type(keys: _Keys, name: str, params: dict) -> None:
    """rope_type from the legacy `type` key, legacy names renamed, as vLLM's config patching does."""
    legacy = params.get("type")
    if legacy is not None and "rope_type" in params and params["rope_type"] != legacy and (
            (legacy, params["rope_type"]) not in (("su", "longrope"), ("mrope", "default"))):
        raise keys.refuse(f"{name}.type", legacy, f"conflicts with rope_type {params['rope_type']!r} "
                          "(vLLM 0.32 refuses the config)")
    params.setdefault("rope_type", legacy if legacy is not None else "default")
    params.pop("type", None)
    if params["rope_type"] == "su":
        params["rope_type"] = "longrope"
    elif params["rope_type"] == "telechat3-yarn":
        factor = params.get("factor")
        if not isinstance(factor, (int, float)):
            raise keys.refuse(f"{name}.factor", factor, "telechat3-yarn needs a number")
        params.update(rope_type="yarn", attention_factor=0.07 * math.log(factor) + 1.0)


def _rope(keys: _Keys, head_dim: int, max_model_len: int | None, raise_positions: bool) -> Rope:
    """The layer's Rope as vLLM 0.32 builds it from this config (see drafter.models.rope)."""
    name, params = _rope_dict(keys)
    _standard_rope_type(keys, name, params)
    if "rope_theta" not in params:
        params["rope_theta"] = keys.get("rope_theta", 10000.0)
    if params["rope_theta"] is None:
        raise keys.refuse("rope_theta", None, "null (vLLM 0.32 cannot build the rotary table)")
    if "partial_rotary_factor" in keys.cfg:
        params.setdefault("partial_rotary_factor", keys.cfg["partial_rotary_factor"])
    # LlamaConfig's default (2048) in the plain layout; vLLM's layer reads 8192 where the key is absent
    own_positions = keys.get("max_position_embeddings", _MISSING if keys.llama_defaults else 8192)
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        if "original_max_position_embeddings" in keys.cfg:  # transformers lets the top-level key win
            params["original_max_position_embeddings"] = keys.cfg["original_max_position_embeddings"]
        elif "original_max_position_embeddings" not in params:
            params["original_max_position_embeddings"] = keys.get("max_position_embeddings")
    positions = int(own_positions)
    if raise_positions and max_model_len:  # vLLM raises an EAGLE head's value to the target's max_model_len
        positions = max(positions, max_model_len)
    if params["rope_type"] == "dynamic" or params["rope_type"] == "longrope":
        keys.get("max_position_embeddings")  # vLLM's result depends on it: refuse a layout without it
    try:
        return resolve_rope(RopeInputs(params, head_dim, positions, max_model_len))
    except RopeRefused as e:  # name the key where the file has it: inside the rope dict, or beside it
        inside = isinstance(keys.cfg.get(name), dict) and e.key in keys.cfg[name]
        raise keys.refuse(f"{name}.{e.key}" if inside or e.key not in keys.cfg else e.key, e.value,
                          e.reason) from None


# ---------------------------------------------------------------------------- layers

@dataclass(frozen=True)
class _LayerContext:
    max_model_len: int | None
    raise_positions: bool  # EAGLE heads: vLLM raises max_position_embeddings to max_model_len
    eagle3_first: bool  # EAGLE-3 layer 0 takes its q/k/v bias from attention_bias alone


def _biases(keys: _Keys, eagle3_first: bool) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) as vLLM's Llama layers read them."""
    attention = keys.flag("attention_bias") or keys.flag("bias")
    qkv = keys.flag("qkv_bias") if "qkv_bias" in keys.cfg else attention
    if eagle3_first:
        qkv = keys.flag("attention_bias")
    return qkv, attention


def _layer_shape(keys: _Keys, sliding_window: int | None, ctx: _LayerContext) -> LayerShape:
    hidden = int(keys.number("hidden_size", kind=int))
    heads = int(keys.number("num_attention_heads", kind=int))
    head_dim = keys.cfg.get("head_dim") or hidden // heads
    qkv_bias, o_bias = _biases(keys, ctx.eagle3_first)
    rope = _rope(keys, int(head_dim), ctx.max_model_len, ctx.raise_positions)
    return LayerShape(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(keys.cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=int(keys.number("intermediate_size", kind=int)),
        rms_norm_eps=keys.number("rms_norm_eps"),
        rope_theta=rope.theta,
        sliding_window=sliding_window,
        rope=rope,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=keys.flag("mlp_bias"),
    )


def _layer_shapes(keys: _Keys, num_layers: int, ctx: _LayerContext, layer_types_key: str = "layer_types"
                  ) -> tuple[LayerShape, ...]:
    _refuse_unmodelled(keys)
    cfg = keys.cfg
    window = cfg.get("sliding_window")
    layer_types = cfg.get(layer_types_key) or ["full_attention"] * num_layers
    if len(layer_types) < num_layers:
        raise keys.refuse(layer_types_key, layer_types, f"{len(layer_types)} entries for {num_layers} layers")
    shapes = []
    for i in range(num_layers):
        if layer_types[i] not in ("full_attention", "sliding_attention"):
            raise keys.refuse(layer_types_key, layer_types, f"layer type {layer_types[i]!r} is not modelled")
        sliding = layer_types[i] == "sliding_attention"
        if sliding and not window:
            raise keys.refuse("sliding_window", window, "a sliding_attention layer needs a window")
        layer_ctx = replace(ctx, eagle3_first=ctx.eagle3_first and i == 0)
        shapes.append(_layer_shape(keys, int(window) if sliding else None, layer_ctx))
    return tuple(shapes)


def parse_target(cfg: dict, source: str | None = None) -> ModelSpec:
    keys = _Keys(cfg, source or getattr(cfg, "source", "config.json"), "", True)
    n = cfg["num_hidden_layers"]
    return ModelSpec(
        method="llama",
        hidden_size=cfg["hidden_size"],
        num_layers=n,
        vocab_size=cfg["vocab_size"],
        layer_shapes=_layer_shapes(keys, n, _LayerContext(None, False, False)),
        draft_vocab_size=cfg["vocab_size"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


# ---------------------------------------------------------------------------- heads

@dataclass(frozen=True)
class _HeadKeys:
    """A head config split by layout: the layer keys, and where the EAGLE-3 keys live."""
    layer: _Keys
    eagle: _Keys  # top level (speculators) or the layer config itself (plain)
    speculators: bool


def _head_keys(cfg: dict, method: str, source: str) -> _HeadKeys:
    if "speculators_config" not in cfg:
        keys = _Keys(cfg, source, "", True)
        return _HeadKeys(keys, keys, False)
    kind = cfg.get("speculators_model_type")
    top = _Keys(cfg, source, "", False)
    if kind != "eagle3" or method != "eagle3":
        raise top.refuse("speculators_model_type", kind, f"the engine serves speculators heads of type 'eagle3' "
                         f"with method eagle3 (method is {method!r})")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise top.refuse("transformer_layer_config", layer, "a speculators config needs the layer config object")
    return _HeadKeys(_Keys(layer, source, "transformer_layer_config.", False), top, True)


def _eagle3_extras(hk: _HeadKeys) -> None:
    """EAGLE-3 variants vLLM 0.32 builds that the engine does not model."""
    eagle_config = hk.layer.cfg.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state", True) is not True:
        raise hk.layer.refuse("eagle_config.use_aux_hidden_state", eagle_config["use_aux_hidden_state"],
                              "heads without the fc over aux states are not modelled")
    norm_before_fc = eagle_config.get("norm_before_fc", hk.eagle.cfg.get("norm_before_fc", False))
    for key, value in (("norm_before_fc", norm_before_fc), ("fc_norm", hk.eagle.cfg.get("fc_norm", False)),
                       ("norm_output", hk.eagle.cfg.get("norm_output", False))):
        if value:
            raise hk.eagle.refuse(key, value, "this EAGLE-3 variant is not modelled")


def _aux_ids(hk: _HeadKeys) -> tuple[int, ...] | None:
    aux = hk.eagle.cfg.get("eagle_aux_hidden_state_layer_ids") or (hk.layer.cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if aux is None:
        return None
    if not isinstance(aux, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
        raise hk.eagle.refuse("eagle_aux_hidden_state_layer_ids", aux, "not a list of layer indices")
    return tuple(aux)


def _num_fc_inputs(hk: _HeadKeys) -> int:
    """How many aux states vLLM 0.32 sizes the EAGLE-3 fc for: num_aux_hidden_states, else the
    count of eagle_config's layer ids, else 3 (the top-level ids do not enter this count)."""
    n = hk.layer.cfg.get("num_aux_hidden_states")
    if n is None:
        ids = (hk.layer.cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        n = len(ids) if ids else 3
    return int(n)


def check_aux(spec: ModelSpec, source: str) -> None:
    """The aux states the target sends must be the ones the fc was built for."""
    if spec.method == "eagle3" and spec.num_fc_inputs and len(set(spec.aux_layer_ids)) != spec.num_fc_inputs:
        raise HeadConfigError(source, "eagle_aux_hidden_state_layer_ids", list(spec.aux_layer_ids),
                              f"{len(set(spec.aux_layer_ids))} distinct layers, but vLLM 0.32 builds the fc "
                              f"for {spec.num_fc_inputs} (num_aux_hidden_states / eagle_config)")


# `mtp`: the project's own dense MTP head (docs/head-configs.md, "MTP"): Llama GQA layers under
# DeepSeek-V3's names, next step fed the pre-norm layer output.  No vLLM 0.32 MTP model computes
# exactly this, so only checkpoints that declare this architecture are served by it.
MTP_ARCHITECTURE = "DrafterLlamaMTP"
# architectures vLLM 0.32 drafts with method "mtp", and which method of this engine serves each
_VLLM_MTP_SERVED_BY = {"DeepseekV3ForCausalLM": "deepseek_mtp", "DeepSeekMTPModel": "deepseek_mtp"}


def _refuse_foreign_mtp(keys: _Keys) -> None:
    """Refuse an `mtp` config whose `architectures` is not MTP_ARCHITECTURE: its checkpoint belongs
    to a vLLM MTP model whose data flow (carried state, norms, layer kind) differs from this head's."""
    arch = keys.cfg.get("architectures")
    if arch == [MTP_ARCHITECTURE]:
        return
    served = sorted({_VLLM_MTP_SERVED_BY[a] for a in arch or () if a in _VLLM_MTP_SERVED_BY})
    other = f"use method {' / '.join(served)} for it" if served else "no method of this engine serves it"
    raise keys.refuse("architectures", arch, f"method mtp serves only this engine's own dense MTP layout "
                      f"(architectures [{MTP_ARCHITECTURE!r}], which matches no vLLM 0.32 MTP model); "
                      f"a checkpoint of another architecture would draft differently from vLLM: {other}")


def parse_head(cfg: dict, method: str, source: str | None = None, max_model_len: int | None = None) -> ModelSpec:
    """Parse a draft head's config.json in either layout; source: the file named in refusals
    (default: where read_config read it); max_model_len: the engine's (EAGLE heads see
    max_position_embeddings raised to it, as vLLM does; longrope picks its factors by it)."""
    if method == "deepseek_mtp":  # MLA + MoE layers: drafter.models.deepseek_config parses them
        from drafter.models.deepseek_loader import deepseek_model_spec, parse_named

        return deepseek_model_spec(parse_named(cfg, source or getattr(cfg, "source", "config.json")))
    source = source or getattr(cfg, "source", "config.json")
    hk = _head_keys(cfg, method, source)
    lcfg = hk.layer.cfg
    ctx = _LayerContext(max_model_len, method in ("eagle", "eagle3"), method == "eagle3")
    aux = _aux_ids(hk)
    if method == "mtp":
        _refuse_foreign_mtp(hk.layer)
        num_layers = lcfg.get("num_nextn_predict_layers") or 0
        if num_layers <= 0:
            raise hk.layer.refuse("num_nextn_predict_layers", lcfg.get("num_nextn_predict_layers"),
                                  "an mtp head needs >= 1")
        mtp_first = lcfg["num_hidden_layers"]
        shapes = _layer_shapes(hk.layer, num_layers, ctx, "mtp_layer_types")
    elif method == "extract_hidden_states":
        if not aux:
            raise hk.layer.refuse("eagle_aux_hidden_state_layer_ids", aux, "extract_hidden_states needs them")
        num_layers, mtp_first, shapes = 0, 0, ()
    else:
        num_layers = lcfg.get("num_hidden_layers", 1)
        mtp_first = 0
        shapes = _layer_shapes(hk.layer, num_layers, ctx)
    vocab = int(hk.layer.number("vocab_size", kind=int))
    draft_vocab, target_hidden, nbr, num_fc = vocab, None, False, 0
    if method == "eagle3":
        _eagle3_extras(hk)
        draft_vocab = hk.eagle.cfg.get("draft_vocab_size") or vocab
        target_hidden = hk.eagle.cfg.get("target_hidden_size")
        # speculators: on unless the config says otherwise; plain configs: off unless they say so
        nbr = hk.eagle.flag("norm_before_residual", hk.speculators)
        num_fc = _num_fc_inputs(hk)
    hidden = int(hk.layer.number("hidden_size", kind=int))
    spec = ModelSpec(
        method=method,
        hidden_size=hidden,
        target_hidden_size=int(target_hidden or hidden),
        num_layers=num_layers,
        vocab_size=vocab,
        layer_shapes=shapes,
        draft_vocab_size=int(draft_vocab),
        aux_layer_ids=aux or (),
        norm_before_residual=nbr,
        tie_word_embeddings=bool(lcfg.get("tie_word_embeddings", False)),
        mtp_first_layer=mtp_first,
        num_fc_inputs=num_fc,
    )
    if aux:
        check_aux(spec, source)
    return spec


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's usual choice when a checkpoint names none: an early, a middle and a late layer."""
    return (2, num_target_layers // 2, num_target_layers - 3) if num_target_layers > 4 else (
        1, max(1, num_target_layers // 2), max(1, num_target_layers - 1))


def with_aux(spec: ModelSpec, aux: tuple[int, ...]) -> ModelSpec:
    return replace(spec, aux_layer_ids=aux)
