"""Load targets and draft heads from local checkpoint directories (config.json + *.safetensors).

Layouts understood:
  target  Hugging Face LlamaForCausalLM ("model.layers.N...", "lm_head", tied or not)
  eagle   SafeAILab / vLLM EAGLE-1 ("fc", "layers.0..."; embed and lm_head from the target)
  eagle3  vLLM speculators ("fc", "layers.0", "norm", "lm_head", "d2t") and SafeAILab ("midlayer.")
  mtp     the engine's own dense MTP layout under DeepSeek-V3's names ("model.layers.{num_hidden_layers + i}.enorm|...";
          docs/head-configs.md, "MTP"); DeepSeek-V3 itself loads as deepseek_mtp
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from drafter.models.heads import HEADS, DraftHead
from drafter.models.llama import LlamaForCausalLM
from drafter.models.llama_shard import shard_spec, shard_weights
from drafter.models.sharding import SINGLE, Shard
from drafter.models.spec import (
    HeadConfigError, ModelSpec, check_aux, config_source, default_aux_layer_ids, parse_head, parse_target, read_config,
    with_aux,
)

IGNORED = re.compile(r"(^t2d$|rotary_emb\.inv_freq$)")


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def _fill(module: torch.nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Copy weights into the module by name; every parameter must be provided, nothing left over."""
    own = dict(module.state_dict())
    missing = sorted(set(own) - set(weights))
    if missing:
        raise ValueError(f"{source}: checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unknown = sorted(k for k in set(weights) - set(own) if not IGNORED.search(k))
    if unknown:
        raise ValueError(f"{source}: unexpected tensors {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    for name, tensor in own.items():
        given = weights[name]
        if tuple(given.shape) != tuple(tensor.shape):
            raise ValueError(f"{source}: {name} has shape {tuple(given.shape)}, expected {tuple(tensor.shape)}")
        tensor.copy_(given.to(tensor.dtype))


def _strip_prefix(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in weights.items()}


def _target_tensors(target_dir: str | Path) -> dict[str, torch.Tensor]:
    weights = _strip_prefix(read_weights(target_dir), "model.")
    if "lm_head.weight" not in weights:  # tied embeddings
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    return weights


def target_weights(target_dir: str | Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """The target as the reference target model runs it (every layer key checked)."""
    return parse_target(read_config(target_dir), config_source(target_dir)), _target_tensors(target_dir)


def load_target(target_dir: str | Path, device="cpu", dtype=torch.float32) -> LlamaForCausalLM:
    spec, weights = target_weights(target_dir)
    model = LlamaForCausalLM(spec)
    with torch.no_grad():
        _fill(model, weights, str(target_dir))
    return model.to(device=device, dtype=dtype).eval()


def _head_weights(method: str, spec: ModelSpec, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a head checkpoint's tensors to this package's module names."""
    if method == "mtp":
        renamed = {}
        for k, v in weights.items():
            m = re.match(r"^(?:model\.)?layers\.(\d+)\.(.*)$", k)
            if m is None:
                raise ValueError(f"mtp checkpoint: tensor {k} is not under model.layers.N")
            index = int(m.group(1)) - spec.mtp_first_layer
            if not 0 <= index < spec.num_layers:
                continue  # the target's own layers may share the file
            renamed[f"layers.{index}.{m.group(2)}"] = v
        return renamed
    weights = _strip_prefix(weights, "model.")
    return {re.sub(r"^midlayer\.", "layers.0.", k): v for k, v in weights.items()}


def _share_from_target(method: str, spec: ModelSpec, weights: dict, target: dict) -> None:
    """Heads borrow the target's embedding (and EAGLE-1 / MTP its lm_head) when they carry none."""
    need = []
    if method in ("eagle", "eagle3"):
        need.append(("embed_tokens.weight", "embed_tokens.weight"))
    if method == "eagle":
        need.append(("lm_head.weight", "lm_head.weight"))
    if method == "mtp":
        for i in range(spec.num_layers):
            need.append((f"layers.{i}.embed_tokens.weight", "embed_tokens.weight"))
            need.append((f"layers.{i}.shared_head.head.weight", "lm_head.weight"))
    for head_name, target_name in need:
        if head_name not in weights:
            if target is None:
                raise ValueError(f"the {method} head lacks {head_name}: pass the target checkpoint directory")
            weights[head_name] = target[target_name]


def _check_against_target(spec: ModelSpec, source: str, head_cfg: dict, target_cfg: dict,
                          target_source: str) -> None:
    """The head's sizes that must agree with the target it drafts for."""
    prefix = "transformer_layer_config." if "speculators_config" in head_cfg else ""
    if target_cfg.get("vocab_size") != spec.vocab_size:
        raise HeadConfigError(source, prefix + "vocab_size", spec.vocab_size,
                              f"the target ({target_source}) has vocab_size {target_cfg.get('vocab_size')}")
    if spec.method != "eagle3" and target_cfg.get("hidden_size") != spec.hidden_size:
        raise HeadConfigError(source, prefix + "hidden_size", spec.hidden_size,
                              f"the target ({target_source}) has hidden_size {target_cfg.get('hidden_size')}")


def load_head(
    head_dir: str | Path,
    method: str,
    target_dir: str | Path | None = None,
    device="cpu",
    dtype=torch.float32,
    max_model_len: int | None = None,
    shard: Shard = SINGLE,
) -> DraftHead:
    """max_model_len: the engine's (rope: vLLM raises an EAGLE head's max_position_embeddings to it).
    shard: the tensor-parallel rank whose share to load (drafter.models.llama_shard); head.spec is
    then that rank's spec (its own heads: the engine sizes the rank's KV cache from it)."""
    if method == "deepseek_mtp":  # MLA + MoE + FP8 blocks: drafter.models.deepseek_loader
        from drafter.models.deepseek_loader import load_deepseek_head

        return load_deepseek_head(head_dir, target_dir, device=device, dtype=dtype, shard=shard)
    source = config_source(head_dir)
    head_cfg = read_config(head_dir)
    spec = parse_head(head_cfg, method, source, max_model_len)
    target = None
    if target_dir is not None:
        # only the target's sizes and tensors: its own layers never run here
        target_cfg = read_config(target_dir)
        _check_against_target(spec, source, head_cfg, target_cfg, config_source(target_dir))
        target = _target_tensors(target_dir)
        if method == "eagle3" and not spec.aux_layer_ids:
            spec = with_aux(spec, default_aux_layer_ids(target_cfg["num_hidden_layers"]))
            check_aux(spec, source)
    if method == "eagle3" and not spec.aux_layer_ids:
        raise ValueError("eagle3 head config names no eagle_aux_hidden_state_layer_ids: pass the target directory")
    weights = _head_weights(method, spec, read_weights(head_dir))
    _share_from_target(method, spec, weights, target)
    if method == "eagle3" and "d2t" not in weights:
        weights["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.long)  # same vocab: identity map
    head = HEADS[method](shard_spec(spec, shard), shard)
    weights = shard_weights(weights, spec, shard)
    with torch.no_grad():
        _fill(head, weights, str(head_dir))
    return head.to(device=device, dtype=dtype).eval()
