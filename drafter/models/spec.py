"""What a checkpoint's config.json says about a model, parsed once into plain values."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from drafter.models.layers import LayerShape


@dataclass(frozen=True)
class ModelSpec:
    method: str  # llama (a target) | eagle | eagle3 | mtp | extract_hidden_states
    hidden_size: int
    num_layers: int
    vocab_size: int  # the target's vocabulary
    layer_shapes: tuple[LayerShape, ...]  # one per decoder layer (sliding window per layer)
    draft_vocab_size: int  # == vocab_size unless an EAGLE-3 head maps a smaller vocab via d2t
    aux_layer_ids: tuple[int, ...] = ()  # target residual streams the head consumes (EAGLE-3, extract)
    fc_bias: bool = False
    norm_before_residual: bool = False
    tie_word_embeddings: bool = False
    mtp_first_layer: int = 0
    target_hidden_size: int = 0  # EAGLE-3 heads may be narrower than their target; 0 = hidden_size

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


def read_config(path: str | Path) -> dict:
    path = Path(path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {path.parent}")
    return json.loads(path.read_text())


def _layer_shapes(cfg: dict, num_layers: int) -> tuple[LayerShape, ...]:
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types") or ["full_attention"] * num_layers
    if len(layer_types) < num_layers:
        raise ValueError(f"config.layer_types has {len(layer_types)} entries for {num_layers} layers")
    shapes = []
    for i in range(num_layers):
        sliding = layer_types[i] == "sliding_attention"
        if sliding and not window:
            raise ValueError("config.layer_types names a sliding_attention layer but sliding_window is unset")
        shapes.append(LayerShape(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            sliding_window=int(window) if sliding else None,
        ))
    return tuple(shapes)


def parse_target(cfg: dict) -> ModelSpec:
    n = cfg["num_hidden_layers"]
    return ModelSpec(
        method="llama",
        hidden_size=cfg["hidden_size"],
        num_layers=n,
        vocab_size=cfg["vocab_size"],
        layer_shapes=_layer_shapes(cfg, n),
        draft_vocab_size=cfg["vocab_size"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def parse_head(cfg: dict, method: str) -> ModelSpec:
    """Parse a draft head's config.json in any of the supported layouts."""
    if method == "eagle3" and "transformer_layer_config" in cfg:  # vLLM speculators format
        layer_cfg = dict(cfg["transformer_layer_config"])
        draft_vocab = cfg.get("draft_vocab_size") or layer_cfg["vocab_size"]
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or layer_cfg.get("eagle_aux_hidden_state_layer_ids")
        # The speculators format turns norm_before_residual on unless the config says otherwise.
        norm_before_residual = bool(cfg.get("norm_before_residual", True))
        target_hidden = cfg.get("target_hidden_size")
        cfg = layer_cfg
    else:
        draft_vocab = cfg.get("draft_vocab_size") or cfg["vocab_size"]
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        norm_before_residual = bool(cfg.get("norm_before_residual", False))
        target_hidden = cfg.get("target_hidden_size")
    if method == "mtp":
        num_layers = cfg.get("num_nextn_predict_layers") or 0
        if num_layers <= 0:
            raise ValueError("an mtp head needs config.num_nextn_predict_layers >= 1")
        mtp_first = cfg["num_hidden_layers"]
        shapes = _layer_shapes({**cfg, "layer_types": cfg.get("mtp_layer_types")}, num_layers)
    elif method == "extract_hidden_states":
        if not aux:
            raise ValueError("extract_hidden_states needs config.eagle_aux_hidden_state_layer_ids")
        num_layers, mtp_first, shapes = 0, 0, ()
    else:
        num_layers = cfg.get("num_hidden_layers", 1)
        mtp_first = 0
        shapes = _layer_shapes(cfg, num_layers)
    if method == "eagle3" and not aux:
        aux = None  # filled in from the target's depth by the loader
    return ModelSpec(
        method=method,
        hidden_size=cfg["hidden_size"],
        target_hidden_size=int(target_hidden or cfg["hidden_size"]),
        num_layers=num_layers,
        vocab_size=cfg["vocab_size"],
        layer_shapes=shapes,
        draft_vocab_size=int(draft_vocab),
        aux_layer_ids=tuple(aux) if aux else (),
        fc_bias=bool(cfg.get("bias", False)) if method == "eagle" else False,
        norm_before_residual=norm_before_residual,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mtp_first_layer=mtp_first,
    )


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's usual choice when a checkpoint names none: an early, a middle and a late layer."""
    return (2, num_target_layers // 2, num_target_layers - 3) if num_target_layers > 4 else (
        1, max(1, num_target_layers // 2), max(1, num_target_layers - 1))


def with_aux(spec: ModelSpec, aux: tuple[int, ...]) -> ModelSpec:
    return replace(spec, aux_layer_ids=aux)
