"""DeepSeek-V3's multi-token-prediction (MTP) layer as released, as a draft head.

MTP layer i (checkpoint prefix model.layers.{num_hidden_layers + i}.) computes, for a token t at
position p with the previous hidden state h (the target's, or the previous step's):
    e = embed_tokens(t), zeroed at position 0
    x = eh_proj([enorm(e) ; hnorm(h)])
    x = x + self_attn(input_layernorm(x))          MLA over the layer's compressed KV cache
    y = x + mlp(post_attention_layernorm(x))       MoE with shared experts (dense MLP if the index says so)
    logits = shared_head.head(shared_head.norm(y)); the next step is fed shared_head.norm(y)
as vLLM 0.32's DeepSeekMTPModel does (it returns the pre-norm y for logits and recycles the
post-norm one).  The head runs layer `step mod num_layers` for the step index it is given, and
compute_logits uses that layer's shared_head.norm; which index each draft step passes is the
engine's mtp_layer_schedule (drafter.engine.proposer): 0 at every step as vLLM 0.32's V1 runner
does (first_layer, the default), or the step itself (per_step).  Every layer owns one KV cache of
the shape kv_cache_shape() gives; one token embedding and one lm_head (the target's) serve them all.
"""

from __future__ import annotations

import torch
from torch import nn

from drafter.attention.metadata import AttentionMetadata
from drafter.models.deepseek_config import DeepseekConfig, DeepseekLayerShape
from drafter.models.fp8 import FP8Linear
from drafter.models.layers import RMSNorm
from drafter.models.mla import MLAAttention
from drafter.models.moe import MoE, ExpertMLP
from drafter.models.sharding import SINGLE, Shard, VocabEmbedding, column_parallel


def kv_cache_shape(shape: DeepseekLayerShape, num_blocks: int, block_size: int) -> tuple[int, int, int]:
    """A layer's compressed cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]."""
    return shape.kv_cache_shape(num_blocks, block_size)


class SharedHead(nn.Module):
    """shared_head: the final norm and the lm_head (rows split by vocabulary over ranks)."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float, shard: Shard):
        super().__init__()
        self.shard = shard
        self.norm = RMSNorm(hidden_size, eps)
        self.head = nn.Linear(hidden_size, shard.span(vocab_size, "vocab_size")[1], bias=False)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:  # [n, hidden_size] -> [n, vocab_size]
        return self.shard.all_gather_last(self.head(normed))


class DeepseekMTPLayer(nn.Module):
    def __init__(self, shape: DeepseekLayerShape, vocab_size: int, fp8_block: tuple[int, int] | None,
                 shard: Shard = SINGLE):
        super().__init__()
        h, eps = shape.hidden_size, shape.rms_norm_eps
        self.embed_tokens = VocabEmbedding(vocab_size, h, shard)
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.shard = shard
        # released unquantised; tensor parallel: this rank's output rows, gathered (column parallel)
        self.eh_proj = nn.Linear(2 * h, shard.span(h, "hidden_size")[1], bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = MLAAttention(shape.attn, fp8_block, shard)
        self.post_attention_layernorm = RMSNorm(h, eps)
        if shape.moe is not None:
            self.mlp = MoE(shape.moe, fp8_block, shard)
        else:
            self.mlp = DenseMLP(h, shape.intermediate_size, fp8_block, shard)
        self.shared_head = SharedHead(h, vocab_size, eps, shard)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        cache: torch.Tensor,  # [num_blocks, block_size, kv_lora + rope]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], before shared_head.norm
        embeds = self.embed_tokens(input_ids)
        embeds = torch.where((positions == 0)[:, None], torch.zeros_like(embeds), embeds)
        x = column_parallel(self.eh_proj, torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1), self.shard)
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseMLP(ExpertMLP):
    """A layer below first_k_dense_replace: one SiLU MLP, split by intermediate columns over ranks."""

    def __init__(self, hidden_size: int, intermediate_size: int, fp8_block, shard: Shard):
        super().__init__(hidden_size, shard.span(intermediate_size, "intermediate_size")[1], fp8_block)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.shard.all_reduce(super().forward(x))


class DeepseekMTPHead(nn.Module):
    """The proposer's head interface (forward / compute_logits per draft step) over MTP layers."""

    def __init__(self, config: DeepseekConfig, shard: Shard = SINGLE):
        super().__init__()
        self.config = config
        self.shard = shard
        self.spec = None  # the engine's ModelSpec, set by whoever builds the engine
        self.layers = nn.ModuleList(
            DeepseekMTPLayer(s, config.vocab_size, config.fp8_block, shard) for s in config.layers)
        self.kv_group_of_layer = tuple(0 for _ in config.layers)
        if shard.world > 1:  # greedy drafts from each rank's top-1 (drafter.models.heads.DraftHead's rule)
            self.greedy_draft = self.sharded_greedy_draft

    def combine_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H]
        return hidden

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def layers_for_step(self, step: int) -> range:
        i = step % len(self.layers)
        return range(i, i + 1)

    def prepare(self, dtype: torch.dtype, kernels: bool = False) -> None:
        """Derive the absorbed attention weights once the checkpoint is loaded (and moved); with
        kernels, FP8 linears and the routed experts run through drafter.kernels.fp8_gemm and every
        RMSNorm is one launch (fuse_norms)."""
        for layer in self.layers:
            layer.self_attn.absorb(dtype)
            if kernels and isinstance(layer.mlp, MoE):
                layer.mlp.stack_experts()
        if kernels:
            self.fuse_norms()
        for module in self.modules():
            if isinstance(module, FP8Linear):
                module.kernel = kernels

    def fuse_norms(self) -> None:
        """Each of a layer's seven RMSNorms (enorm, hnorm, the MLA q / kv latent norms, input, post-
        attention, shared_head) as one Triton launch instead of seven torch ops: the same math in
        float32 (drafter.kernels.fused_kernels.rms_norm); a step's fixed launch cost is most of a
        small batch's time at DeepSeek-V3 shapes."""
        import types

        from drafter.models.fusion import rms_norm

        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.forward = types.MethodType(rms_norm, module)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_caches: list[torch.Tensor],  # per layer: [num_blocks, block_size, kv_lora + rope]
        metas: list[AttentionMetadata],  # per KV group (one: MLA layers are full attention)
        backend=None,  # unused: MLA attends over its own compressed cache
        step: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (hidden for logits, hidden fed to the next step), [n, H]
        i = step % len(self.layers)
        layer = self.layers[i]
        y = layer(input_ids, positions, hidden, kv_caches[i], metas[self.kv_group_of_layer[i]])
        return y, layer.shared_head.norm(y)

    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:  # [n, H] -> [n, V]
        shared = self.layers[step % len(self.layers)].shared_head
        return shared.logits(shared.norm(hidden))

    def sharded_greedy_draft(self, hidden: torch.Tensor, step: int) -> torch.Tensor:  # [n, H] -> [n] int64
        """Greedy ids over the vocabulary split by rows, without gathering [n, V] logits (Shard.greedy_ids)."""
        shared = self.layers[step % len(self.layers)].shared_head
        return self.shard.greedy_ids(shared.head(shared.norm(hidden)))
