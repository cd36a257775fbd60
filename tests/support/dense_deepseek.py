"""A dense fp32 DeepSeek-V3 MTP reference written from the architecture's equations.

It shares no code with drafter.models: it reads config.json and the safetensors files itself,
dequantises every FP8 weight up front (a Kronecker product of the block scales), rotates the rope
part as complex numbers, runs MLA in its textbook (non-absorbed) form with keys and values
expanded per head, and routes each token through the experts one at a time in Python.  No cache:
DenseDeepseekReference (a DenseReference) recomputes every query over the whole logged history.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.support.dense import DenseReference


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def dequantized(tensors: dict[str, torch.Tensor], block) -> dict[str, torch.Tensor]:
    """Every weight with a weight_scale_inv turned into float32 values; scales dropped."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        if scale is not None:
            rows, cols = t.shape
            full = torch.kron(scale.float(), torch.ones(block[0], block[1]))[:rows, :cols]
            t = t.float() * full
        out[name] = t.float()
    return out


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def silu_mlp(w: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate = x @ w[prefix + "gate_proj.weight"].T
    return (gate * torch.sigmoid(gate) * (x @ w[prefix + "up_proj.weight"].T)) @ w[prefix + "down_proj.weight"].T


class DenseDeepseekMTP:
    """head-like: (tokens, positions, hidden) of a whole history -> outputs of its last row."""

    def __init__(self, head_dir, target_dir=None):
        cfg = json.loads((Path(head_dir) / "config.json").read_text())
        self.cfg = cfg
        block = (cfg.get("quantization_config") or {}).get("weight_block_size")
        tensors = dequantized(read_tensors(Path(head_dir)), block)
        vocab = dequantized(read_tensors(Path(target_dir)), None) if target_dir else tensors
        self.eps = cfg["rms_norm_eps"]
        first = cfg["num_hidden_layers"]
        self.layers = []
        for i in range(cfg["num_nextn_predict_layers"]):
            prefix = f"model.layers.{first + i}."
            w = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            w["embed_tokens.weight"] = vocab["model.embed_tokens.weight"]
            w["shared_head.head.weight"] = vocab["lm_head.weight"]
            self.layers.append(w)
        self._rope_setup()

    # ---------------------------------------------------------------- rope
    def _rope_setup(self) -> None:
        cfg, dim = self.cfg, self.cfg["qk_rope_head_dim"]
        rs = cfg.get("rope_scaling") or {}
        base = cfg["rope_theta"]
        freqs = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        factor = rs.get("factor", 1.0)
        self.rope_magnitude, attn_m = 1.0, 1.0
        if rs:
            orig = rs["original_max_position_embeddings"]

            def dim_of(rot):
                return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(dim_of(rs.get("beta_fast", 32))), 0)
            high = min(math.ceil(dim_of(rs.get("beta_slow", 1))), dim - 1)
            ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
            freqs = freqs / factor * ramp + freqs * (1 - ramp)

            def m(scale):
                return 0.1 * scale * math.log(factor) + 1.0 if factor > 1 else 1.0

            self.rope_magnitude = m(rs.get("mscale", 1)) / m(rs.get("mscale_all_dim", 0))
            attn_m = m(rs.get("mscale_all_dim", 0)) ** 2
        self.freqs = freqs.float()
        self.scale = (cfg["qk_nope_head_dim"] + dim) ** -0.5 * attn_m

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [L, ..., dim]
        angles = positions.double()[:, None] * self.freqs.double()[None, :]
        rot = torch.polar(torch.full_like(angles, self.rope_magnitude), angles).to(torch.complex64)  # [L, dim/2]
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rot.shape[-1],)
        return torch.view_as_real(pairs * rot.view(shape)).flatten(-2)

    # ---------------------------------------------------------------- blocks
    def attention(self, w: dict, h: torch.Tensor, positions, written, mask) -> torch.Tensor:  # [1, hidden]
        c = self.cfg
        heads, nope, rope_d, vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        L, rank = h.shape[0], c["kv_lora_rank"]
        kv = h @ w["self_attn.kv_a_proj_with_mqa.weight"].T
        c_kv = rms(kv[:, :rank], w["self_attn.kv_a_layernorm.weight"], self.eps) * written[:, None]
        k_pe = self.rope(kv[:, rank:], positions) * written[:, None]
        if c.get("q_lora_rank"):
            q_c = rms(h[-1:] @ w["self_attn.q_a_proj.weight"].T, w["self_attn.q_a_layernorm.weight"], self.eps)
            q = (q_c @ w["self_attn.q_b_proj.weight"].T).view(1, heads, nope + rope_d)
        else:
            q = (h[-1:] @ w["self_attn.q_proj.weight"].T).view(1, heads, nope + rope_d)
        q = torch.cat((q[..., :nope], self.rope(q[..., nope:], positions[-1:])), dim=-1)[0]  # [heads, qk]
        up = (c_kv @ w["self_attn.kv_b_proj.weight"].T).view(L, heads, nope + vd)
        keys = torch.cat((up[..., :nope], k_pe[:, None, :].expand(L, heads, rope_d)), dim=-1)  # [L, heads, qk]
        scores = torch.einsum("hd,lhd->hl", q, keys) * self.scale
        probs = torch.nan_to_num(torch.softmax(scores.masked_fill(~mask[None, :], float("-inf")), dim=-1))
        out = torch.einsum("hl,lhv->hv", probs, up[..., nope:]).reshape(1, heads * vd)
        return out @ w["self_attn.o_proj.weight"].T

    def experts_of(self, w: dict, x: torch.Tensor) -> tuple[list[int], list[float]]:
        """One token's routed experts and weights, by the released rule, one step at a time."""
        c = self.cfg
        scores = torch.sigmoid(x.double() @ w["mlp.gate.weight"].double().T).tolist()
        bias = w.get("mlp.gate.e_score_correction_bias")
        biased = [s + float(b) for s, b in zip(scores, bias.tolist())] if bias is not None else scores
        n_exp, groups = len(scores), c["n_group"]
        per = n_exp // groups
        candidates = list(range(n_exp))
        if n_exp > groups and n_exp % groups == 0:
            rank_of = [sum(sorted(biased[g * per:(g + 1) * per], reverse=True)[:2]) if bias is not None
                       else max(biased[g * per:(g + 1) * per]) for g in range(groups)]
            best = sorted(range(groups), key=lambda g: -rank_of[g])[: c["topk_group"]]
            candidates = [e for e in candidates if e // per in best]
        chosen = sorted(candidates, key=lambda e: -biased[e])[: c["num_experts_per_tok"]]
        weights = [scores[e] for e in chosen]
        if c.get("norm_topk_prob"):
            weights = [v / sum(weights) for v in weights]
        return chosen, weights

    def mlp(self, w: dict, layer_index: int, x: torch.Tensor) -> torch.Tensor:  # [1, hidden]
        c = self.cfg
        if layer_index < c.get("first_k_dense_replace", 0):
            return silu_mlp(w, "mlp.", x)
        chosen, weights = self.experts_of(w, x[0])
        routed = sum(float(v) * silu_mlp(w, f"mlp.experts.{e}.", x) for e, v in zip(chosen, weights))
        out = c.get("routed_scaling_factor", 1.0) * routed
        if c.get("n_shared_experts"):
            out = out + silu_mlp(w, "mlp.shared_experts.", x)
        return out

    # ---------------------------------------------------------------- head interface
    def __call__(self, toks, positions, hid, caches, metas, backend, step: int = 0):
        i = step % len(self.layers)
        w = self.layers[i]
        emb = w["embed_tokens.weight"][toks] * (positions != 0)[:, None]
        x = torch.cat((rms(emb, w["enorm.weight"], self.eps), rms(hid.float(), w["hnorm.weight"], self.eps)), -1)
        x = x @ w["eh_proj.weight"].T
        h = rms(x, w["input_layernorm.weight"], self.eps)
        x = x[-1:] + self.attention(w, h, positions, backend.written.float(), backend.mask[-1])
        y = x + self.mlp(w, self.cfg["num_hidden_layers"] + i, rms(x, w["post_attention_layernorm.weight"], self.eps))
        return y, rms(y, w["shared_head.norm.weight"], self.eps)

    def compute_logits(self, h: torch.Tensor, step: int = 0) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        w = self.layers[step % len(self.layers)]
        return rms(h, w["shared_head.norm.weight"], self.eps) @ w["shared_head.head.weight"].T

    def combine_hidden_states(self, hidden):
        return hidden.float()

    def draft_to_target(self, ids):
        return ids


class DenseDeepseekReference(DenseReference):
    """DenseReference's history bookkeeping (per request, per MTP layer) over the dense MTP model."""

    def __init__(self, head_dir, target_dir, k: int, max_model_len: int):
        super().__init__(DenseDeepseekMTP(head_dir, target_dir), k, max_model_len)
        self.num_units = len(self.head.layers)
