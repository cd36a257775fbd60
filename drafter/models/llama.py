"""A plain Llama target model over the paged KV cache: the reference target engine's model,
and the source of real hidden states (final-normed and aux residual streams) in tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from drafter.models.layers import DecoderLayer, RMSNorm
from drafter.models.spec import ModelSpec


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [num_tokens, vocab_size]
    hidden_states: torch.Tensor  # [num_tokens, hidden_size], after the final norm
    aux_hidden_states: torch.Tensor | None  # [num_tokens, len(aux_layer_ids) * hidden_size]


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s) for s in spec.layer_shapes)
        self.norm = RMSNorm(spec.hidden_size, spec.layer_shapes[0].rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.kv_group_of_layer = spec.kv_group_of_layer

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer
        metas: list,  # per KV group
        backend,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> TargetOutput:
        x = self.embed_tokens(input_ids)
        aux = []
        for i, layer in enumerate(self.layers):
            if i in aux_layer_ids:
                aux.append(x)  # id i = the residual stream after i layers
            x = layer(x, positions, kv_caches[i], metas[self.kv_group_of_layer[i]], backend)
        if len(self.layers) in aux_layer_ids:
            aux.append(x)
        hidden = self.norm(x)
        return TargetOutput(
            logits=self.lm_head(hidden),
            hidden_states=hidden,
            aux_hidden_states=torch.cat(aux, dim=-1) if aux else None,
        )
