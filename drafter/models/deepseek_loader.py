"""Load DeepSeek-V3 MTP layers from a checkpoint in the released layout.

The MTP layers live in the target's own checkpoint as model.layers.{num_hidden_layers + i}.*:
enorm, hnorm, eh_proj, embed_tokens, shared_head.{norm,head}, self_attn.* (MLA), mlp.* (gate with
e_score_correction_bias, experts.{e}.*, shared_experts.*), the input / post-attention norms.
FP8 weights come with `<name>.weight_scale_inv`.  Only the tensors of those layers (and the
top-level embedding / lm_head) are read, file by file, so the 600+ GB of target layers never
load.  As vLLM 0.32 does for MTP, the token embedding and lm_head are the target's: from
target_dir when given, else the checkpoint's top-level model.embed_tokens / lm_head, else the
first MTP layer's embedding for every layer and each layer's own shared_head.head (the release
holds copies equal to the target's).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from drafter.models.deepseek_config import DeepseekConfig, UnsupportedConfig, parse_deepseek, value_at
from drafter.models.deepseek_v3 import DeepseekMTPHead
from drafter.models.fp8 import FP8, FP8Linear, dequantize
from drafter.models.sharding import SINGLE, Shard

IGNORED = re.compile(r"rotary_emb\.inv_freq$")
TOP_LEVEL = {"model.embed_tokens.weight": "embed", "lm_head.weight": "lm_head"}


def _files_for(directory: Path, wanted) -> list[Path]:
    """The safetensors files that may hold wanted names (all of them without an index)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({directory / f for name, f in weight_map.items() if wanted(name)})
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    return files


def read_selected(directory: str | Path, wanted) -> dict[str, torch.Tensor]:
    """Every tensor whose checkpoint name satisfies wanted(name), read lazily per file."""
    directory = Path(directory)
    out: dict[str, torch.Tensor] = {}
    for path in _files_for(directory, wanted):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if wanted(name):
                    out[name] = f.get_tensor(name)
    return out


def mtp_weights(directory: str | Path, config: DeepseekConfig) -> tuple[dict, dict]:
    """(the MTP layers' tensors renamed to layers.{i}.*, the top-level embed / lm_head found)."""
    first, count = config.num_hidden_layers, len(config.layers)
    pattern = re.compile(r"^model\.layers\.(\d+)\.(.*)$")

    def wanted(name: str) -> bool:
        m = pattern.match(name)
        return name in TOP_LEVEL or (m is not None and first <= int(m.group(1)) < first + count)

    layers, top = {}, {}
    for name, tensor in read_selected(directory, wanted).items():
        if name in TOP_LEVEL:
            top[TOP_LEVEL[name]] = tensor
        else:
            m = pattern.match(name)
            layers[f"layers.{int(m.group(1)) - first}.{m.group(2)}"] = tensor
    return layers, top


def _target_vocab_weights(target_dir: str | Path) -> dict[str, torch.Tensor]:
    found = read_selected(target_dir, lambda n: n in TOP_LEVEL)
    return {TOP_LEVEL[k]: v for k, v in found.items()}


def _share_vocab(weights: dict, vocab: dict, num_layers: int) -> None:
    """Put the target's embedding / lm_head in every MTP layer (vLLM shares both for MTP).  Without a
    top-level embedding every layer takes the first MTP layer's copy: vLLM keeps one embedding for
    all MTP layers and loads only the first layer's."""
    embed = vocab.get("embed", weights.get("layers.0.embed_tokens.weight"))
    for i in range(num_layers):
        if embed is not None:
            weights[f"layers.{i}.embed_tokens.weight"] = embed
        if "lm_head" in vocab:
            weights[f"layers.{i}.shared_head.head.weight"] = vocab["lm_head"]
        elif "embed" in vocab and f"layers.{i}.shared_head.head.weight" not in weights:
            weights[f"layers.{i}.shared_head.head.weight"] = vocab["embed"]  # tied target


def _linear_modules(head: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in head.named_modules() if isinstance(m, (FP8Linear, nn.Linear))}


def _dequantize_where_scaled(weights: dict, head: nn.Module, block: tuple[int, int] | None) -> None:
    """A checkpoint weight with a scale that the head holds unquantised is dequantised on load."""
    for name, module in _linear_modules(head).items():
        scale = weights.get(f"{name}.weight_scale_inv")
        if scale is None or isinstance(module, FP8Linear):
            continue
        if block is None:
            raise ValueError(f"{name}.weight_scale_inv present but config.quantization_config names no block size")
        weights[f"{name}.weight"] = dequantize(weights[f"{name}.weight"], scale, block)
        del weights[f"{name}.weight_scale_inv"]


def _check_names(own: dict, weights: dict, source: str) -> None:
    missing = sorted(set(own) - set(weights))
    if missing:
        raise ValueError(f"{source}: checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unknown = sorted(k for k in set(weights) - set(own) if not IGNORED.search(k))
    if unknown:
        raise ValueError(f"{source}: unexpected tensors {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")


def _fill(head: nn.Module, weights: dict, source: str) -> None:
    own = head.state_dict()
    _check_names(own, weights, source)
    for name, tensor in own.items():
        given = weights[name]
        if tuple(given.shape) != tuple(tensor.shape):
            raise ValueError(f"{source}: {name} has shape {tuple(given.shape)}, expected {tuple(tensor.shape)}")
        if tensor.dtype == FP8 and given.dtype != FP8:
            raise ValueError(f"{source}: {name} is {given.dtype}; its weight_scale_inv says float8_e4m3fn")
        tensor.copy_(given.to(tensor.dtype))


def parse_named(cfg: dict, source: str) -> DeepseekConfig:
    """parse_deepseek whose refusals name the file, key and value (HeadConfigError, as for every head)."""
    from drafter.models.spec import HeadConfigError

    try:
        return parse_deepseek(cfg)
    except UnsupportedConfig as err:
        raise HeadConfigError(source, err.key, value_at(cfg, err.key), err.why) from err


def load_deepseek_mtp(
    head_dir: str | Path,
    target_dir: str | Path | None = None,
    device="cpu",
    dtype: torch.dtype = torch.bfloat16,
    keep_fp8: bool = True,
    shard: Shard = SINGLE,
    kernels: bool | None = None,
) -> DeepseekMTPHead:
    """Build the MTP head of a DeepSeek-V3-layout checkpoint.  keep_fp8=False dequantises every
    FP8 weight into `dtype` at load (more memory, no per-call dequantisation).  kernels (default:
    on a GPU) runs FP8 linears and the routed experts through the Triton grouped GEMM."""
    from drafter.models.deepseek_shard import shard_weights
    from drafter.models.spec import config_source, read_config

    if dtype == torch.float16:
        raise ValueError("dtype float16: vLLM 0.32 rescales DeepSeek's residual stream in float16; use bfloat16")
    config = parse_named(read_config(head_dir), config_source(head_dir))
    built = config if keep_fp8 else replace(config, fp8_block=None)
    weights, vocab = mtp_weights(head_dir, config)
    if target_dir is not None:
        vocab = _target_vocab_weights(target_dir) or vocab
    _share_vocab(weights, vocab, len(config.layers))
    head = DeepseekMTPHead(built, shard)
    weights = shard_weights(weights, built, shard)
    _dequantize_where_scaled(weights, head, config.fp8_block)
    with torch.no_grad():
        _fill(head, weights, str(head_dir))
    head = head.to(device=device, dtype=dtype).eval()
    head.prepare(dtype, torch.device(device).type == "cuda" if kernels is None else kernels)
    return head


def deepseek_model_spec(config: DeepseekConfig):
    """The engine's ModelSpec of a deepseek_mtp head (layer shapes are DeepseekLayerShape)."""
    from drafter.models.spec import ModelSpec

    return ModelSpec(method="deepseek_mtp", hidden_size=config.hidden_size, num_layers=len(config.layers),
                     vocab_size=config.vocab_size, layer_shapes=config.layers, draft_vocab_size=config.vocab_size,
                     tie_word_embeddings=config.tie_word_embeddings, mtp_first_layer=config.num_hidden_layers)


def load_deepseek_head(head_dir, target_dir=None, device="cpu", dtype: torch.dtype = torch.bfloat16,
                       shard: Shard = SINGLE):
    """load_deepseek_mtp with the engine's ModelSpec attached (what load_head returns for deepseek_mtp)."""
    head = load_deepseek_mtp(head_dir, target_dir, device=device, dtype=dtype, shard=shard)
    head.spec = deepseek_model_spec(head.config)
    return head
