"""One tensor-parallel rank's share of a Llama-family draft head (EAGLE-1, EAGLE-3, Llama-style MTP).

shard_spec(spec, shard) gives the rank's ModelSpec: each layer shape holds its own query heads, KV
heads and MLP columns (the engine sizes the rank's KV cache from it); vocabulary and hidden sizes
stay whole.  shard_weights(weights, spec, shard) cuts the checkpoint's tensors (names as the head's
modules spell them) by these rules:
  vocabulary rows   embed_tokens, lm_head, layers.N.embed_tokens, layers.N.shared_head.head
  hidden rows       fc, layers.N.eh_proj (gathered after the GEMM: column parallel)
  head rows         self_attn.q_proj (query heads), k_proj / v_proj (KV heads; a KV head is
                    replicated onto world / num_kv_heads ranks when there are fewer KV heads than ranks)
  head columns      self_attn.o_proj.weight
  MLP               gate_proj / up_proj rows, down_proj.weight columns
  replicated        norms, d2t, o_proj / down_proj biases (added once after the sum)
A size that does not split evenly is refused, naming its config key.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from drafter.models.sharding import Shard
from drafter.models.spec import ModelSpec

ROW, COL = 0, 1


def _layer_share(shape, shard: Shard):
    first_q, q = shard.span(shape.num_heads, "num_attention_heads")
    first_kv, kv = shard.kv_span(shape.num_kv_heads, shape.num_heads)
    first_i, inter = shard.span(shape.intermediate_size, "intermediate_size")
    return (first_q, q), (first_kv, kv), (first_i, inter)


def shard_spec(spec: ModelSpec, shard: Shard) -> ModelSpec:
    """The rank's ModelSpec (its layers' own heads and MLP columns); the whole spec at world 1."""
    if shard.world == 1:
        return spec
    shapes = []
    for shape in spec.layer_shapes:
        (_, q), (_, kv), (_, inter) = _layer_share(shape, shard)
        shapes.append(replace(shape, num_heads=q, num_kv_heads=kv, intermediate_size=inter))
    shard.span(spec.hidden_size, "hidden_size")
    shard.span(spec.vocab_size, "vocab_size")
    if spec.method == "eagle3":
        shard.span(spec.draft_vocab_size, "draft_vocab_size")
    return replace(spec, layer_shapes=tuple(shapes))


def _vocab_items(rest: str, spec: ModelSpec) -> int:
    if rest.startswith("lm_head.") and spec.method == "eagle3":
        return spec.draft_vocab_size
    return spec.vocab_size


def _cut_rule(name: str, spec: ModelSpec, shard: Shard) -> tuple[int, int, int] | None:
    """(dim, start, count) of this rank's slice of the tensor `name`; None = replicated."""
    m = re.match(r"^layers\.(\d+)\.(.*)$", name)
    rest = m.group(2) if m else name
    if rest in ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight"):
        start, count = shard.span(_vocab_items(rest, spec), "vocab_size")
        return ROW, start, count
    if rest in ("fc.weight", "fc.bias", "eh_proj.weight"):
        start, count = shard.span(spec.hidden_size, "hidden_size")
        return ROW, start, count
    if m is None:
        return None
    shape = spec.layer_shapes[int(m.group(1))]
    (fq, q), (fkv, kv), (fi, inter) = _layer_share(shape, shard)
    d = shape.head_dim
    if rest.startswith("self_attn.q_proj."):
        return ROW, fq * d, q * d
    if rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        return ROW, fkv * d, kv * d
    if rest == "self_attn.o_proj.weight":
        return COL, fq * d, q * d
    if rest.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
        return ROW, fi, inter
    if rest == "mlp.down_proj.weight":
        return COL, fi, inter
    return None


def shard_weights(weights: dict[str, torch.Tensor], spec: ModelSpec, shard: Shard) -> dict[str, torch.Tensor]:
    """This rank's tensors under the same names (spec: the whole head's, before shard_spec)."""
    if shard.world == 1:
        return weights
    out = {}
    for name, tensor in weights.items():
        rule = _cut_rule(name, spec, shard)
        if rule is None:
            out[name] = tensor
        else:
            dim, start, count = rule
            out[name] = tensor.narrow(dim, start, count).contiguous()
    return out
