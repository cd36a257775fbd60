"""Draft heads: EAGLE-1, EAGLE-3 and (multi-layer) MTP.

Every head answers the same three questions the proposer asks:
  combine_hidden_states: target hidden states -> the head's hidden input (first pass only)
  forward(step):         (token ids, positions, hidden) -> (hidden for logits, hidden carried to the next step)
  compute_logits(step):  hidden -> logits over the head's vocabulary; draft_to_target maps ids back

Tensor parallel (a Shard of world N, the spec from drafter.models.llama_shard.shard_spec): the
embedding and lm_head hold this rank's vocabulary rows (lookups summed, logits gathered over ranks),
fc / eh_proj this rank's output rows (gathered), attention its own heads and the MLP its own
intermediate columns (partial sums added).  Every rank ends each step with the whole hidden state
and the whole logits, so every rank samples the same drafts.  A greedy draft needs no whole logits:
a sharded head's greedy_draft takes each rank's top-1 over its own vocabulary rows and keeps the
best (Shard.greedy_ids, torch.argmax's ties), one small gather instead of [tokens, vocab].
"""

from __future__ import annotations

import torch
from torch import nn

from drafter.attention.metadata import AttentionMetadata
from drafter.models.layers import Attention, DecoderLayer, LayerShape, MLP, RMSNorm
from drafter.models.sharding import SINGLE, Shard, column_parallel, embedding
from drafter.models.spec import ModelSpec


class DraftHead(nn.Module):
    def __init__(self, spec: ModelSpec, shard: Shard = SINGLE):
        super().__init__()
        self.spec = spec
        self.shard = shard
        self.kv_group_of_layer = spec.kv_group_of_layer
        if shard.world > 1:  # the proposer's greedy hook (drafter.engine.proposer._sample)
            self.greedy_draft = self.sharded_greedy_draft

    def local_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:  # [n, H] -> [n, vocab / world]
        """This rank's vocabulary rows of the logits (all of them in one process)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:  # [n, H] -> [n, vocab]
        return self.shard.all_gather_last(self.local_logits(hidden, step))

    def sharded_greedy_draft(self, hidden: torch.Tensor, step: int) -> torch.Tensor:  # [n, H] -> [n] int64
        """Greedy draft ids in the target vocabulary without gathering the logits."""
        return self.draft_to_target(self.shard.greedy_ids(self.local_logits(hidden, step)))

    def combine_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def layers_for_step(self, step: int) -> range:
        """Indices of the decoder layers (and KV caches) a draft step runs."""
        return range(len(self.spec.layer_shapes))

    def _run_layers(self, x, positions, kv_caches, metas, backend, layer_ids):
        for i in layer_ids:
            x = self.layers[i](x, positions, kv_caches[i], metas[self.kv_group_of_layer[i]], backend)
        return x


class EagleHead(DraftHead):
    """EAGLE-1: fc over [embed; target hidden], Llama layers (the first without input norm),
    and the target's lm_head applied to the un-normed output."""

    def __init__(self, spec: ModelSpec, shard: Shard = SINGLE):
        super().__init__(spec, shard)
        h = spec.hidden_size
        self.embed_tokens = embedding(spec.vocab_size, h, shard)
        self.fc = nn.Linear(2 * h, shard.span(h, "hidden_size")[1], bias=spec.fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(s, input_norm=i > 0, shard=shard)
                                    for i, s in enumerate(spec.layer_shapes))
        self.lm_head = nn.Linear(h, shard.span(spec.vocab_size, "vocab_size")[1], bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_caches: list[torch.Tensor],
        metas: list[AttentionMetadata],
        backend,
        step: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = column_parallel(self.fc, torch.cat((self.embed_tokens(input_ids), hidden), dim=-1), self.shard)
        x = self._run_layers(x, positions, kv_caches, metas, backend, self.layers_for_step(step))
        return x, x

    def local_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:  # [n, H] -> [n, vocab / world]
        return self.lm_head(hidden)


class Eagle3Layer(nn.Module):
    """EAGLE-3's first layer: attention reads [input_norm(embed); hidden_norm(hidden)] (2H wide)."""

    def __init__(self, shape: LayerShape, norm_before_residual: bool, shard: Shard = SINGLE):
        super().__init__()
        h = shape.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(h, shape.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, shape.rms_norm_eps)
        self.self_attn = Attention(shape, input_size=2 * h, shard=shard)
        self.post_attention_layernorm = RMSNorm(h, shape.rms_norm_eps)
        self.mlp = MLP(h, shape.intermediate_size, shape.mlp_bias, shard)

    def forward(self, embeds, hidden, positions, kv_cache, meta, backend):
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        attn_in = torch.cat((self.input_layernorm(embeds), normed_hidden), dim=-1)
        x = residual + self.self_attn(attn_in, positions, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(DraftHead):
    """EAGLE-3: fc fuses the target's aux hidden states (n*H -> H); own norm and lm_head over a
    draft vocabulary whose ids map to target ids as target = draft + d2t[draft]."""

    def __init__(self, spec: ModelSpec, shard: Shard = SINGLE):
        super().__init__(spec, shard)
        h = spec.hidden_size
        shapes = spec.layer_shapes
        self.embed_tokens = embedding(spec.vocab_size, h, shard)
        self.fc = nn.Linear(spec.hidden_input_width, shard.span(h, "hidden_size")[1], bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(shapes[0], spec.norm_before_residual, shard)]
                                    + [DecoderLayer(s, shard=shard) for s in shapes[1:]])
        self.norm = RMSNorm(h, shapes[0].rms_norm_eps)
        self.lm_head = nn.Linear(h, shard.span(spec.draft_vocab_size, "draft_vocab_size")[1], bias=False)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))

    def combine_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, num_aux * H] -> [n, H]
        return column_parallel(self.fc, hidden, self.shard)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def forward(self, input_ids, positions, hidden, kv_caches, metas, backend, step: int = 0):
        first, *rest = self.layers
        x = first(self.embed_tokens(input_ids), hidden, positions, kv_caches[0], metas[self.kv_group_of_layer[0]],
                  backend)
        for i, layer in enumerate(rest, start=1):
            x = layer(x, positions, kv_caches[i], metas[self.kv_group_of_layer[i]], backend)
        return self.norm(x), x  # logits read the normed state; the next step consumes the pre-norm one

    def local_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:  # [n, H] -> [n, draft vocab / world]
        return self.lm_head(hidden)


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float, shard: Shard = SINGLE):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = nn.Linear(hidden_size, shard.span(vocab_size, "vocab_size")[1], bias=False)


class MTPLayer(DecoderLayer):
    """One MTP module of the engine's own dense layout (architectures ["DrafterLlamaMTP"]):
    enorm/hnorm/eh_proj in front of a pre-norm Llama GQA decoder layer, with its own shared_head
    (norm + lm_head).  DeepSeek-V3's names, not its math (MLA + MoE: deepseek_mtp)."""

    def __init__(self, shape: LayerShape, vocab_size: int, shard: Shard = SINGLE):
        super().__init__(shape, shard=shard)
        h = shape.hidden_size
        self.embed_tokens = embedding(vocab_size, h, shard)
        self.enorm = RMSNorm(h, shape.rms_norm_eps)
        self.hnorm = RMSNorm(h, shape.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, shard.span(h, "hidden_size")[1], bias=False)
        self.shared_head = SharedHead(h, vocab_size, shape.rms_norm_eps, shard)


class MTPHead(DraftHead):
    """The engine's own dense MTP head; for a token t at position p and previous hidden h:
        x = eh_proj([enorm(embed(t), zero at p == 0) ; hnorm(h)]);  y = decoder_layer(x)
        logits = shared_head.head(shared_head.norm(y));  the next step is fed y (pre-norm)
    vLLM 0.32's DeepSeekMTPModel feeds shared_head.norm(y) instead, and no vLLM MTP model pairs
    this data flow with a Llama layer, so parse_head serves only configs declaring this layout.
    Draft step i runs MTP layer i (mod the number of layers); each layer keeps its own KV cache,
    written only by the steps that run it."""

    def __init__(self, spec: ModelSpec, shard: Shard = SINGLE):
        super().__init__(spec, shard)
        self.layers = nn.ModuleList(MTPLayer(s, spec.vocab_size, shard) for s in spec.layer_shapes)

    def layers_for_step(self, step: int) -> range:
        i = step % len(self.layers)
        return range(i, i + 1)

    def forward(self, input_ids, positions, hidden, kv_caches, metas, backend, step: int = 0):
        i = step % len(self.layers)
        layer = self.layers[i]
        embeds = layer.embed_tokens(input_ids)
        embeds = torch.where((positions == 0)[:, None], torch.zeros_like(embeds), embeds)  # MTP ignores position 0
        x = column_parallel(layer.eh_proj, torch.cat((layer.enorm(embeds), layer.hnorm(hidden)), dim=-1), self.shard)
        x = layer(x, positions, kv_caches[i], metas[self.kv_group_of_layer[i]], backend)
        return x, x

    def local_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:  # [n, H] -> [n, vocab / world]
        shared = self.layers[step % len(self.layers)].shared_head
        return shared.head(shared.norm(hidden))


HEADS = {"eagle": EagleHead, "eagle3": Eagle3Head, "mtp": MTPHead}
