"""Throwaway writer of tiny random checkpoints in the layouts vLLM 0.32 loads.

Temporary: to be replaced by `drafter make-tiny` once it lands on main.
Weights are random but biased so that the target mostly continues t -> t+1 and the
heads mostly guess that rule: drafts then get partially accepted, which exercises
varied rejected-token counts in the recordings.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file


def _llama_cfg(hidden, layers, heads, kv_heads, head_dim, inter, vocab, max_pos):
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def _layer(g, prefix, hidden, heads, kv_heads, head_dim, inter, std, qkv_in=None):
    qkv_in = qkv_in or hidden
    r = lambda *s: torch.randn(*s, generator=g) * std  # noqa: E731
    return {
        f"{prefix}.self_attn.q_proj.weight": r(heads * head_dim, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": r(kv_heads * head_dim, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": r(kv_heads * head_dim, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": r(hidden, heads * head_dim),
        f"{prefix}.mlp.gate_proj.weight": r(inter, hidden),
        f"{prefix}.mlp.up_proj.weight": r(inter, hidden),
        f"{prefix}.mlp.down_proj.weight": r(hidden, inter),
        f"{prefix}.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
    }


def write_all(out: str, seed: int = 0, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=32,
              inter=128, vocab=384, draft_vocab=256, max_pos=2048, noise=0.13):
    g = torch.Generator().manual_seed(seed)
    tgt_dir, e1_dir, e3_dir = (os.path.join(out, n) for n in ("target", "eagle", "eagle3"))
    for d in (tgt_dir, e1_dir, e3_dir):
        os.makedirs(d, exist_ok=True)

    # ---- target ----
    emb = torch.randn(vocab, hidden, generator=g)
    sd = {"model.embed_tokens.weight": emb.clone(), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        sd.update(_layer(g, f"model.layers.{i}", hidden, heads, kv_heads, head_dim, inter, noise))
        sd[f"model.layers.{i}.input_layernorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    # lm_head row v looks like emb[v-1]: the target mostly continues t -> t+1
    sd["lm_head.weight"] = torch.roll(emb, shifts=1, dims=0) + 0.3 * torch.randn(vocab, hidden, generator=g)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(tgt_dir, "model.safetensors"))
    cfg = _llama_cfg(hidden, layers, heads, kv_heads, head_dim, inter, vocab, max_pos)
    with open(os.path.join(tgt_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)

    # ---- EAGLE-1 (HF Llama config, fc over [embed; hidden], no lm_head / embed) ----
    fc = torch.zeros(hidden, 2 * hidden)
    fc[:, :hidden] = torch.eye(hidden)
    fc += 0.05 * torch.randn(hidden, 2 * hidden, generator=g)
    e1 = {"fc.weight": fc}
    e1.update(_layer(g, "layers.0", hidden, heads, kv_heads, head_dim, inter, noise))
    save_file({k: v.contiguous() for k, v in e1.items()}, os.path.join(e1_dir, "model.safetensors"))
    c1 = _llama_cfg(hidden, 1, heads, kv_heads, head_dim, inter, vocab, max_pos)
    with open(os.path.join(e1_dir, "config.json"), "w") as f:
        json.dump(c1, f, indent=2)

    # ---- EAGLE-3 (speculators format, reduced draft vocab with d2t/t2d) ----
    aux_ids = [1, 2, layers - 1]
    keep = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values  # draft id -> target id
    d2t = keep - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    fc3 = torch.zeros(hidden, 3 * hidden)
    fc3[:, :hidden] = torch.eye(hidden)
    fc3 += 0.05 * torch.randn(hidden, 3 * hidden, generator=g)
    e3 = {"fc.weight": fc3, "d2t": d2t.to(torch.int64), "t2d": t2d,
          "norm.weight": torch.ones(hidden),
          # draft row j looks like emb[target(j) - 2]: from the state of token t guess t+2
          "lm_head.weight": torch.roll(emb, shifts=2, dims=0)[keep] + 0.3 * torch.randn(draft_vocab, hidden, generator=g)}
    e3.update(_layer(g, "layers.0", hidden, heads, kv_heads, head_dim, inter, noise, qkv_in=2 * hidden))
    e3["layers.0.input_layernorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    e3["layers.0.hidden_norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    save_file({k: v.contiguous() for k, v in e3.items()}, os.path.join(e3_dir, "model.safetensors"))
    layer_cfg = _llama_cfg(hidden, 1, heads, kv_heads, head_dim, inter, vocab, max_pos)
    layer_cfg["architectures"] = ["LlamaForCausalLM"]
    c3 = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "torch_dtype": "float32",
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": aux_ids,
        "transformer_layer_config": layer_cfg,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": os.path.abspath(tgt_dir),
                         "architectures": ["LlamaForCausalLM"]},
        },
    }
    with open(os.path.join(e3_dir, "config.json"), "w") as f:
        json.dump(c3, f, indent=2)
    return tgt_dir, e1_dir, e3_dir


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(write_all(a.out, a.seed))
