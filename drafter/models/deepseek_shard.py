"""Slice a DeepSeek MTP checkpoint's tensors into one tensor-parallel rank's share.

Rules (names as the head's modules spell them, layers.{i}.*):
  vocabulary rows    embed_tokens, shared_head.head
  hidden rows        eh_proj (its outputs gathered after the GEMM: column parallel)
  head rows          self_attn.q_b_proj / q_proj / kv_b_proj (whole heads: qk or nope+v rows each)
  head columns       self_attn.o_proj (v_head_dim columns per head)
  experts            mlp.experts.{e}: only this rank's experts; mlp.shared_experts: rank 0
  dense MLP          gate_proj / up_proj rows, down_proj columns
  everything else    replicated (norms, q_a / kv_a projections, the router)
An FP8 weight's weight_scale_inv is sliced by the same rule in block units, so a cut must fall on
a block edge (DeepSeek-V3's 128 heads x 192 / 256 / 128 features at TP 2, 4, 8 all do).
"""

from __future__ import annotations

import re

import torch

from drafter.models.deepseek_config import DeepseekConfig
from drafter.models.sharding import Shard

ROW, COL = 0, 1


def _rule(rest: str, layer, config: DeepseekConfig) -> tuple[int, int] | None:
    """(dim, units per item) to split this tensor by, and the item count's owner; None = replicated."""
    a = layer.attn
    if rest.startswith(("embed_tokens.", "shared_head.head.", "eh_proj.")):
        return ROW, 1
    if rest.startswith(("self_attn.q_b_proj.", "self_attn.q_proj.")):
        return ROW, a.qk_head_dim
    if rest.startswith("self_attn.kv_b_proj."):
        return ROW, a.qk_nope_head_dim + a.v_head_dim
    if rest.startswith("self_attn.o_proj."):
        return COL, a.v_head_dim
    if layer.moe is None and rest.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
        return ROW, 1
    if layer.moe is None and rest.startswith("mlp.down_proj."):
        return COL, 1
    return None


def _items(rest: str, layer, config: DeepseekConfig) -> int:
    if rest.startswith(("embed_tokens.", "shared_head.head.")):
        return config.vocab_size
    if rest.startswith("eh_proj."):
        return config.hidden_size
    if rest.startswith("self_attn."):
        return layer.attn.num_heads
    return layer.intermediate_size


def _cut(tensor: torch.Tensor, dim: int, start: int, count: int, block: int, name: str) -> torch.Tensor:
    if block > 1 and (start % block or count % block):
        raise ValueError(f"{name}: the tensor-parallel cut [{start}, {start + count}) is not on a {block}-wide "
                         "FP8 block edge")
    return tensor.narrow(dim, start // block, count // block).contiguous()


def _slice(name: str, tensor: torch.Tensor, layer, config: DeepseekConfig, shard: Shard) -> torch.Tensor:
    rest = name.split(".", 2)[2]
    rule = _rule(rest, layer, config)
    if rule is None:
        return tensor
    dim, per_item = rule
    first, count = shard.span(_items(rest, layer, config), rest)
    block = 1
    if name.endswith("weight_scale_inv"):
        block = config.fp8_block[dim]
    return _cut(tensor, dim, first * per_item, count * per_item, block, name)


def _held(rest: str, layer, shard: Shard) -> bool:
    """Whether this rank holds the tensor at all (experts split, shared experts on rank 0)."""
    m = re.match(r"mlp\.experts\.(\d+)\.", rest)
    if m is not None and layer.moe is not None:
        first, count = shard.span(layer.moe.num_experts, "n_routed_experts")
        return first <= int(m.group(1)) < first + count
    return not rest.startswith("mlp.shared_experts.") or shard.rank == 0


def shard_weights(weights: dict[str, torch.Tensor], config: DeepseekConfig, shard: Shard) -> dict[str, torch.Tensor]:
    """This rank's tensors, renamed as before; the whole dict when the world is one process."""
    if shard.world == 1:
        return weights
    out = {}
    for name, tensor in weights.items():
        index, rest = name.split(".", 2)[1:]
        layer = config.layers[int(index)]
        if _held(rest, layer, shard):
            out[name] = _slice(name, tensor, layer, config, shard)
    return out
