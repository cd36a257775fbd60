"""Method `mtp`, exact or refused.

No vLLM 0.32 MTP model runs a Llama GQA layer with this head's data flow (DeepSeekMTPModel feeds the
next step shared_head.norm(y) and runs MLA + MoE; ERNIE's MTP has no shared_head and other names;
MiMo's, Step3.5's, Qwen3-Next's, GLM's layers and norms differ: docs/head-configs.md, "MTP").  So
`mtp` serves only the engine's own layout, architectures ["DrafterLlamaMTP"], and these tests pin
(1) that layout against a reference written from its documented equations, and (2) the refusal of
every other `architectures` value, naming the key, the value and the method that serves it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafter.models.loader import load_head
from drafter.models.spec import MTP_ARCHITECTURE, HeadConfigError, parse_head, read_config
from drafter.models.tiny import write_tiny
from tests.support.dense import DenseBackend

NUM_TOKENS = 30  # beyond the tiny sliding window (24), so layer 1's window bites


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """mtp-multi: two MTP layers, the second a sliding-window one."""
    root = tmp_path_factory.mktemp("mtp-exact")
    assert write_tiny("mtp-multi", root, seed=3) == "mtp"
    return root


# ------------------------------------------------------------------------- reference equations

def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [T, H] -> [T, H]
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:  # [T, heads, d]
    """Neox rotation: the halves (a, b) at angle p / theta^(2i/d) become (a cos - b sin, b cos + a sin)."""
    d = x.shape[-1]
    angle = positions[:, None].double() / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos()[:, None].float(), angle.sin()[:, None].float()
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def _attention(w: dict, p: str, x: torch.Tensor, positions: torch.Tensor, cfg: dict,
               window: int | None) -> torch.Tensor:  # x: [T, H] -> [T, H]
    """Causal GQA self-attention (query head j reads kv head j // group), optionally windowed."""
    t, hd = x.shape[0], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    q = _rotate((x @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, hd), positions, cfg["rope_theta"])
    k = _rotate((x @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, hd), positions, cfg["rope_theta"])
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, hd)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    visible = (j <= i) & ((j > i - window) if window else True)
    out = torch.empty(t, nh, hd)
    for h in range(nh):
        kv = h // (nh // nkv)
        scores = (q[:, h] @ k[:, kv].T) / hd ** 0.5
        out[:, h] = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v[:, kv]
    return out.reshape(t, nh * hd) @ w[p + "self_attn.o_proj.weight"].T


def _reference_step(w: dict, embed: torch.Tensor, cfg: dict, layer: int, tokens: torch.Tensor,
                    positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V], state fed to the next step [T, H]) of MTP layer `layer`, from the layout's equations."""
    p, eps = f"model.layers.{cfg['num_hidden_layers'] + layer}.", cfg["rms_norm_eps"]
    kinds = cfg.get("mtp_layer_types") or ["full_attention"] * cfg["num_nextn_predict_layers"]
    window = cfg["sliding_window"] if kinds[layer] == "sliding_attention" else None
    e = embed[tokens] * (positions != 0)[:, None]  # the embedding at position 0 is zeroed
    x = torch.cat((_rms(e, w[p + "enorm.weight"], eps), _rms(hidden, w[p + "hnorm.weight"], eps)), -1)
    x = x @ w[p + "eh_proj.weight"].T
    x = x + _attention(w, p, _rms(x, w[p + "input_layernorm.weight"], eps), positions, cfg, window)
    m = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    y = x + (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
             ) @ w[p + "mlp.down_proj.weight"].T
    logits = _rms(y, w[p + "shared_head.norm.weight"], eps) @ w[p + "shared_head.head.weight"].T
    return logits, y  # the next step reads y before shared_head.norm


def _engine_step(head, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, step: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # tokens, positions: [T]; hidden: [T, H]
    """(logits [T, V], carried state [T, H]) of the loaded head's draft step, causal dense attention."""
    t = tokens.shape[0]
    backend = DenseBackend(torch.ones(t, t, dtype=torch.bool).tril(), torch.ones(t, dtype=torch.bool))
    groups = [None] * head.spec.num_kv_groups
    with torch.no_grad():
        for_logits, carried = head(tokens, positions, hidden, [None] * len(head.layers), groups, backend, step=step)
        return head.compute_logits(for_logits, step), carried


def test_mtp_head_equals_the_layouts_equations_over_three_steps(tiny):
    """Step s runs layer s mod 2; each step reads the previous step's pre-norm output (a head that
    recycled shared_head.norm(y), as vLLM's DeepSeekMTPModel does, fails at step 1)."""
    cfg = read_config(tiny / "head")
    w = load_file(str(tiny / "head" / "model.safetensors"))
    embed = load_file(str(tiny / "target" / "model.safetensors"))["model.embed_tokens.weight"]
    head = load_head(tiny / "head", "mtp", tiny / "target")
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(NUM_TOKENS)
    ref_hidden = eng_hidden = torch.randn(NUM_TOKENS, cfg["hidden_size"], generator=g)
    for step in range(3):
        tokens = torch.randint(0, cfg["vocab_size"], (NUM_TOKENS,), generator=g)
        ref_logits, ref_hidden = _reference_step(w, embed, cfg, step % 2, tokens, positions, ref_hidden)
        eng_logits, eng_hidden = _engine_step(head, tokens, positions, eng_hidden, step)
        torch.testing.assert_close(eng_hidden, ref_hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(eng_logits, ref_logits, rtol=1e-4, atol=1e-3)
        assert torch.equal(eng_logits.argmax(-1), ref_logits.argmax(-1))


# ------------------------------------------------------------------------- refusals

def _head_with(tiny: Path, root: Path, architectures) -> Path:
    """A copy of the tiny mtp head whose config says `architectures` (absent when _ABSENT)."""
    out = root / "head"
    shutil.copytree(tiny / "head", out)
    cfg = json.loads((out / "config.json").read_text())
    if architectures is _ABSENT:
        del cfg["architectures"]
    else:
        cfg["architectures"] = architectures
    (out / "config.json").write_text(json.dumps(cfg))
    return out


_ABSENT = object()
FOREIGN = [
    (["DeepseekV3ForCausalLM"], "use method deepseek_mtp"),  # what the tiny head declared before
    (["DeepSeekMTPModel"], "use method deepseek_mtp"),
    (["Ernie4_5_MoeForCausalLM"], "no method of this engine serves it"),
    (["MiMoForCausalLM"], "no method of this engine serves it"),
    (["Qwen3NextForCausalLM"], "no method of this engine serves it"),
    (["Glm4MoeForCausalLM"], "no method of this engine serves it"),
    (["Step3p5ForCausalLM"], "no method of this engine serves it"),
    (["LlamaForCausalLM"], "no method of this engine serves it"),
    ([MTP_ARCHITECTURE, "LlamaForCausalLM"], "no method of this engine serves it"),
    ([], "no method of this engine serves it"),
    (_ABSENT, "no method of this engine serves it"),
]


@pytest.mark.parametrize("architectures,hint", FOREIGN, ids=lambda v: "absent" if v is _ABSENT else str(v))
def test_mtp_refuses_every_other_architecture(tiny, tmp_path, architectures, hint):
    head_dir = _head_with(tiny, tmp_path, architectures)
    with pytest.raises(HeadConfigError) as e:
        load_head(head_dir, "mtp", tiny / "target")
    value = None if architectures is _ABSENT else architectures
    assert e.value.key == "architectures" and e.value.value == value
    assert str(e.value).startswith(f"{head_dir / 'config.json'}: architectures = {value!r}: ")
    assert MTP_ARCHITECTURE in str(e.value) and hint in str(e.value)


def test_the_tiny_mtp_checkpoints_declare_the_own_layout(tiny, tmp_path):
    assert read_config(tiny / "head")["architectures"] == [MTP_ARCHITECTURE]
    write_tiny("mtp", tmp_path)
    spec = parse_head(read_config(tmp_path / "head"), "mtp")
    assert spec.method == "mtp" and spec.num_layers == 1
