"""Head config.json files, exactly or refused: published heads parsed at real shape (built on the
meta device, no weights) with their resolved numbers checked; every key on the refuse list fails
`DraftEngine.from_dirs` (what `drafter serve` calls) with the file, the key and the value named;
honoured keys reach the modules."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.engine.engine import DraftEngine
from drafter.models.heads import HEADS
from drafter.models.loader import load_head
from drafter.models.spec import MTP_ARCHITECTURE, HeadConfigError, default_aux_layer_ids, parse_head, with_aux
from drafter.models.tiny import head_sizes, write_tiny

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "head_configs"
LLAMA31_ROPE = dict(rope_type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)

# file: (method, target layers, expected numbers); rope: the Rope fields that must come out
PUBLISHED = {
    "safeailab-eagle3-llama3.1-instruct-8b.json": ("eagle3", 32, dict(
        hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, eps=1e-5, vocab=128256,
        draft_vocab=32000, target_hidden=4096, aux=(2, 16, 29), norm_before_residual=False, rope=LLAMA31_ROPE)),
    "safeailab-eagle3-llama3.3-instruct-70b.json": ("eagle3", 80, dict(
        hidden=8192, heads=64, kv_heads=8, head_dim=128, intermediate=28672, eps=1e-5, vocab=128256,
        draft_vocab=32000, target_hidden=8192, aux=(2, 40, 77), norm_before_residual=False, rope=LLAMA31_ROPE)),
    "speculators-eagle3-llama3.1-8b-instruct.json": ("eagle3", 32, dict(
        hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, eps=1e-5, vocab=128256,
        draft_vocab=32000, target_hidden=4096, aux=(2, 16, 29), norm_before_residual=True, rope=LLAMA31_ROPE)),
    "speculators-eagle3-qwen3-8b.json": ("eagle3", 36, dict(
        hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, eps=1e-6, vocab=151936,
        draft_vocab=32000, target_hidden=4096, aux=(2, 18, 33), norm_before_residual=True,
        rope=dict(rope_type="default", theta=1e6))),
    "safeailab-eagle-llama3-instruct-8b.json": ("eagle", 32, dict(
        hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, eps=1e-5, vocab=128256,
        draft_vocab=128256, target_hidden=4096, aux=(), norm_before_residual=False,
        rope=dict(rope_type="default", theta=500000.0))),
}


def _config(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_head_at_real_shape(name):
    method, target_layers, want = PUBLISHED[name]
    spec = parse_head(_config(name), method, name, max_model_len=8192)
    if method == "eagle3" and not spec.aux_layer_ids:  # as the loader does with the target's depth
        spec = with_aux(spec, default_aux_layer_ids(target_layers))
    shape = spec.layer_shapes[0]
    assert (spec.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size) == (
        want["hidden"], want["heads"], want["kv_heads"], want["head_dim"], want["intermediate"])
    assert shape.rms_norm_eps == want["eps"]
    assert (spec.vocab_size, spec.draft_vocab_size, spec.target_width) == (
        want["vocab"], want["draft_vocab"], want["target_hidden"])
    assert spec.aux_layer_ids == want["aux"] and spec.norm_before_residual == want["norm_before_residual"]
    assert not (shape.qkv_bias or shape.o_bias or shape.mlp_bias) and shape.sliding_window is None
    rope = shape.rope
    assert rope.rotary_dim == rope.head_dim == want["head_dim"]
    for field, value in want["rope"].items():
        assert getattr(rope, field) == value, (field, getattr(rope, field), value)
    with torch.device("meta"):
        head = HEADS[method](spec)
    attn = head.layers[0].self_attn
    in_width = 2 * want["hidden"] if method == "eagle3" else want["hidden"]
    assert attn.q_proj.weight.shape == (want["heads"] * want["head_dim"], in_width)
    assert attn.k_proj.weight.shape == (want["kv_heads"] * want["head_dim"], in_width)
    assert attn.o_proj.weight.shape == (want["hidden"], want["heads"] * want["head_dim"])
    assert head.lm_head.weight.shape == (want["draft_vocab"], want["hidden"])
    fc_in = 3 * want["target_hidden"] if method == "eagle3" else 2 * want["hidden"]
    assert head.fc.weight.shape == (want["hidden"], fc_in) and head.fc.bias is None
    assert attn.q_proj.bias is None and head.layers[0].mlp.down_proj.bias is None


def test_llama31_scaling_reaches_the_frequencies():
    """The published Llama-3.1 head rotates with llama3-scaled frequencies, not theta 500000 alone."""
    spec = parse_head(_config("speculators-eagle3-llama3.1-8b-instruct.json"), "eagle3", "x", 8192)
    rope = spec.layer_shapes[0].rope
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    inv = rope.inv_freq()
    long = 2 * math.pi / plain > 8192
    assert long.any() and torch.equal(inv[long], plain[long] / 8.0)


def test_qwen3_mtp_style_config_is_refused_by_architectures_then_model_type():
    cfg = _config("qwen3-8b-mtp-style.json")
    with pytest.raises(HeadConfigError) as e:
        parse_head(cfg, "mtp", "qwen3-8b-mtp-style.json")
    assert e.value.key == "architectures" and e.value.value == ["Qwen3ForCausalLM"]
    cfg["architectures"] = [MTP_ARCHITECTURE]  # declaring the own MTP layout does not make a Qwen3 layer Llama
    with pytest.raises(HeadConfigError) as e:
        parse_head(cfg, "mtp", "qwen3-8b-mtp-style.json")
    assert e.value.key == "model_type" and e.value.value == "qwen3"
    assert "qwen3-8b-mtp-style.json: model_type = 'qwen3'" in str(e.value)


# ------------------------------------------------------------------------- refusals through from_dirs

def _tiny(root: Path, variant: str) -> Path:
    out = root / f"cfg-{variant}"
    if not (out / "head" / "config.json").exists():
        write_tiny(variant, out)
    return out


def _edit(layer: dict, top: dict, path: str, value) -> None:
    """Set `path` ("a.b" = nested) in the layer config, or at the top level with a "top:" prefix;
    value None deletes where the key is one the case removes ("<del>")."""
    target = top if path.startswith("top:") else layer
    keys = path.removeprefix("top:").split(".")
    for k in keys[:-1]:
        target = target.setdefault(k, {})
    if value == "<del>":
        del target[keys[-1]]
    else:
        target[keys[-1]] = value


L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 32}
# (variant, edited key, value, key the error names, value it names); speculators keys live under
# transformer_layer_config unless marked "top:"
REFUSED = [
    ("eagle", "rope_scaling", {"rope_type": "foo", "factor": 2.0}, "rope_scaling.rope_type", "foo"),
    ("eagle3", "rope_parameters", {"rope_type": "foo", "rope_theta": 1e4},
     "transformer_layer_config.rope_parameters.rope_type", "foo"),
    ("eagle", "rope_scaling", {"type": "linear", "rope_type": "dynamic", "factor": 2.0}, "rope_scaling.type",
     "linear"),
    ("eagle", "rope_scaling", {"rope_type": "default", "mrope_section": [4, 6, 6]}, "rope_scaling.mrope_section",
     [4, 6, 6]),
    ("eagle", "rope_scaling", {"full_attention": {"rope_type": "default"}}, "rope_scaling",
     {"full_attention": {"rope_type": "default"}}),
    ("eagle", "rope_scaling", {"rope_type": "linear", "factor": 2.0, "finetuned": True}, "rope_scaling.finetuned",
     True),
    ("eagle", "rope_scaling", {k: v for k, v in L3.items() if k != "low_freq_factor"},
     "rope_scaling.low_freq_factor", None),
    ("eagle3", "rope_scaling", {"rope_type": "dynamic", "alpha": 2.0},
     "transformer_layer_config.rope_scaling.factor", None),
    ("eagle", "rope_theta", None, "rope_theta", None),
    ("eagle", "partial_rotary_factor", 1.5, "partial_rotary_factor", 1.5),
    ("eagle", "rotary_emb_base", 5000.0, "rotary_emb_base", 5000.0),
    ("eagle", "hidden_act", "gelu", "hidden_act", "gelu"),
    ("eagle3", "hidden_act", "relu", "transformer_layer_config.hidden_act", "relu"),
    ("eagle", "model_type", "qwen3", "model_type", "qwen3"),
    ("eagle", "is_causal", False, "is_causal", False),
    ("eagle", "logit_scale", 2.0, "logit_scale", 2.0),
    ("eagle", "quantization_config", {"quant_method": "fp8"}, "quantization_config", {"quant_method": "fp8"}),
    ("eagle", "layer_types", ["chunked_attention"], "layer_types", ["chunked_attention"]),
    ("eagle3", "rms_norm_eps", "<del>", "transformer_layer_config.rms_norm_eps", None),
    ("eagle3", "top:speculators_model_type", "medusa", "speculators_model_type", "medusa"),
    ("eagle3", "top:norm_before_fc", True, "norm_before_fc", True),
    ("eagle3", "top:fc_norm", True, "fc_norm", True),
    ("eagle3", "top:norm_output", True, "norm_output", True),
    ("eagle3", "eagle_config", {"use_aux_hidden_state": False},
     "transformer_layer_config.eagle_config.use_aux_hidden_state", False),
    ("eagle3", "top:eagle_aux_hidden_state_layer_ids", [1, 2], "eagle_aux_hidden_state_layer_ids", [1, 2]),
    ("eagle3", "vocab_size", 1024, "transformer_layer_config.vocab_size", 1024),
    ("eagle", "hidden_size", 96, "hidden_size", 96),
]


@pytest.mark.parametrize("case", REFUSED, ids=[f"{c[0]}:{c[1]}" for c in REFUSED])
def test_refused_key_fails_from_dirs_naming_it(tiny_root, tmp_path, case):
    variant, path, value, key, named_value = case
    src = _tiny(tiny_root, variant)
    head = tmp_path / "head"
    shutil.copytree(src / "head", head)
    config = json.loads((head / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)
    _edit(layer, config, path, value)
    (head / "config.json").write_text(json.dumps(config))
    cfg = EngineConfig(method=variant, max_model_len=64, kv_groups=(KVGroupSpec(16, 16),))
    with pytest.raises(HeadConfigError) as e:
        DraftEngine.from_dirs(head, src / "target", cfg)
    assert e.value.key == key and e.value.value == named_value
    assert str(e.value).startswith(f"{head / 'config.json'}: {key} = {named_value!r}: ")


def test_fc_bias_tensor_is_refused(tiny_root, tmp_path):
    """vLLM 0.32 builds EAGLE fc layers without bias and fails on an fc.bias tensor: so does the loader."""
    from safetensors.torch import load_file, save_file

    src = _tiny(tiny_root, "eagle")
    head = tmp_path / "head"
    shutil.copytree(src / "head", head)
    weights = load_file(str(head / "model.safetensors"))
    weights["fc.bias"] = torch.zeros(weights["fc.weight"].shape[0])
    save_file(weights, str(head / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensors.*fc.bias"):
        load_head(head, "eagle", src / "target")


# ------------------------------------------------------------------------- honoured keys reach the modules

def _layer_config(root: Path, variant: str, **flags) -> tuple[Path, dict]:
    out = root / ("hon-" + variant + "-" + "-".join(f"{k}={v}" for k, v in sorted(flags.items())))
    write_tiny(variant, out, sizes=head_sizes(variant, **flags))
    return out, json.loads((out / "head" / "config.json").read_text())


def test_biases_follow_vllms_llama_layers(tmp_path):
    """attention_bias: q/k/v and o biases; `bias` alone means the same in vLLM's Llama layers;
    qkv_bias overrides the q/k/v part; EAGLE-3's first layer takes q/k/v bias from attention_bias only."""
    _, cfg = _layer_config(tmp_path, "eagle")
    base = dict(cfg, attention_bias=False)
    for extra, qkv, o in (({"attention_bias": True}, True, True), ({"bias": True}, True, True),
                          ({"attention_bias": True, "qkv_bias": False}, False, True)):
        shape = parse_head({**base, **extra}, "eagle").layer_shapes[0]
        assert (shape.qkv_bias, shape.o_bias) == (qkv, o), extra
    _, cfg3 = _layer_config(tmp_path, "eagle3")
    layer = dict(cfg3["transformer_layer_config"], attention_bias=False, bias=True)
    shape = parse_head({**cfg3, "transformer_layer_config": layer}, "eagle3").layer_shapes[0]
    assert (shape.qkv_bias, shape.o_bias) == (False, True)


def test_honoured_keys_reach_the_head(tmp_path):
    out, _ = _layer_config(tmp_path, "eagle3", rope="yarn", rope_layout="params", attention_bias=True,
                           mlp_bias=True, head_dim=64, partial_rotary_factor=0.5)
    head = load_head(out / "head", "eagle3", out / "target", max_model_len=64)
    layer = head.layers[0]
    assert layer.self_attn.q_proj.weight.shape == (4 * 64, 128) and layer.self_attn.q_proj.bias is not None
    assert layer.self_attn.o_proj.bias is not None and layer.mlp.gate_proj.bias is not None
    rope = layer.self_attn.rope
    assert (rope.rope_type, rope.rotary_dim, rope.head_dim, rope.factor) == ("yarn", 32, 64, 4.0)
    assert rope.magnitude == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert layer.hidden_norm.eps == 1e-5


def test_ignored_keys_change_nothing(tmp_path):
    """torch_dtype / dtype (the engine's dtype rules, as vLLM runs heads in the target's) and a head's
    tie_word_embeddings (vLLM shares embeddings by tensor presence) do not change the parsed head."""
    _, cfg = _layer_config(tmp_path, "eagle")
    spec = parse_head(cfg, "eagle")
    for extra in ({"torch_dtype": "bfloat16"}, {"dtype": "float16"}, {"transformers_version": "9.9"}):
        assert parse_head({**cfg, **extra}, "eagle").layer_shapes == spec.layer_shapes
    assert parse_head({**cfg, "tie_word_embeddings": True}, "eagle").layer_shapes == spec.layer_shapes


def test_eagle_heads_see_positions_raised_to_max_model_len(tmp_path):
    """vLLM raises an EAGLE head's max_position_embeddings to the target's max_model_len; that
    moves dynamic NTK's base (with max_trained_positions) - the engine's max_model_len does the same."""
    _, cfg = _layer_config(tmp_path, "eagle")
    cfg = dict(cfg, max_position_embeddings=64,
               rope_scaling={"rope_type": "dynamic", "factor": 2.0, "max_trained_positions": 32})
    small, large = (parse_head(cfg, "eagle", max_model_len=m).layer_shapes[0].rope for m in (32, 256))
    assert small.dynamic_base_ratio == 2.0 * 64 / 32 - 1.0
    assert large.dynamic_base_ratio == 2.0 * 256 / 32 - 1.0


def test_make_tiny_writes_each_configuration(tmp_path):
    """drafter make-tiny's head flags land in config.json and the weights, and the head loads."""
    from safetensors.torch import load_file

    from drafter.cli import main

    out = tmp_path / "t"
    assert main(["make-tiny", "--method", "eagle3", "--out", str(out), "--rope", "llama3", "--rope-layout", "params",
                 "--eagle3-layout", "plain", "--attention-bias", "--mlp-bias", "--head-dim", "64",
                 "--partial-rotary-factor", "0.5"]) == 0
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and "rope_scaling" not in cfg
    assert cfg["rope_parameters"]["rope_type"] == "llama3" and cfg["rope_parameters"]["rope_theta"] == 500000.0
    assert (cfg["head_dim"], cfg["attention_bias"], cfg["mlp_bias"], cfg["partial_rotary_factor"]) == (64, True, True,
                                                                                                        0.5)
    weights = load_file(str(out / "head" / "model.safetensors"))
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (4 * 64, 128) and "midlayer.mlp.up_proj.bias" in weights
    head = load_head(out / "head", "eagle3", out / "target", max_model_len=64)
    rope = head.layers[0].self_attn.rope
    assert (rope.rope_type, rope.rotary_dim, rope.original_max_position_embeddings) == ("llama3", 32, 32)
    assert main(["make-tiny", "--method", "eagle", "--out", str(tmp_path / "e"), "--rope", "yarn"]) == 0
    legacy = json.loads((tmp_path / "e" / "head" / "config.json").read_text())
    assert legacy["rope_scaling"]["rope_type"] == "yarn" and legacy["rope_theta"] == 10000.0
