"""DeepSeek-V3's mixture of experts: the released router, routed experts and shared experts.

Router (vLLM 0.32's grouped top-k):
    scores  = sigmoid(gate(x)) (or softmax)                         [n, E]
    choice  = scores + e_score_correction_bias                       (noaux_tc only: selection only)
    groups  : E experts in n_group groups; a group's score is the sum of its top two choice values
              with the bias, its max without; only the topk_group best groups stay eligible
    ids     = top-k of choice among eligible experts
    weights = scores[ids], divided by their sum when norm_topk_prob
Output:
    y = shared_experts(x) + routed_scaling_factor * sum_k weights_k * expert_{ids_k}(x)
Each expert (and the shared MLP) is SiLU-gated: down(silu(gate(x)) * up(x)).

Expert parallel: a rank holds experts [start, start + E / world) (routing is computed in full on
every rank) and the shared MLP on rank 0 only; the partial outputs are summed by an all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from drafter.models.deepseek_config import MoEShape
from drafter.models.fp8 import make_linear
from drafter.models.sharding import SINGLE, Shard


def route(
    logits: torch.Tensor,  # [num_tokens, num_experts] float32
    bias: torch.Tensor | None,  # [num_experts] float32, e_score_correction_bias
    shape: MoEShape,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [n, top_k] float32, expert ids [n, top_k] int64)
    """Pick each token's experts and their weights (routed_scaling_factor not applied)."""
    scores = logits.sigmoid() if shape.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    choice = scores + bias[None, :] if bias is not None else scores
    if shape.grouped:
        choice = _keep_top_groups(choice, bias is not None, shape)
    ids = choice.topk(shape.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if shape.normalize_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _keep_top_groups(choice: torch.Tensor, biased: bool, shape: MoEShape) -> torch.Tensor:  # [n, E]
    n = choice.shape[0]
    grouped = choice.view(n, shape.num_groups, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1) if biased else grouped.amax(dim=-1)
    top = group_scores.topk(shape.topk_groups, dim=-1).indices  # [n, topk_group]
    keep = torch.zeros(n, shape.num_groups, dtype=torch.bool, device=choice.device).scatter_(1, top, True)
    return choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(n, -1), float("-inf"))


class ExpertMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, fp8_block: tuple[int, int] | None):
        super().__init__()
        self.gate_proj = make_linear(hidden_size, intermediate_size, fp8_block)
        self.up_proj = make_linear(hidden_size, intermediate_size, fp8_block)
        self.down_proj = make_linear(intermediate_size, hidden_size, fp8_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """The router's linear layer (never quantised) and its selection-only bias."""

    def __init__(self, shape: MoEShape):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape.num_experts, shape.hidden_size))
        if shape.correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(shape.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, num_experts] float32
        return F.linear(x.float(), self.weight.float())

    def _apply(self, fn, recurse=True):
        """The bias stays float32 (as released) whatever dtype the rest of the model is cast to."""
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if bias is not None:
            moved = fn(bias)
            self.e_score_correction_bias = moved if moved.dtype == torch.float32 else bias.to(moved.device)
        return self


class MoE(nn.Module):
    def __init__(self, shape: MoEShape, fp8_block: tuple[int, int] | None, shard: Shard = SINGLE):
        super().__init__()
        self.shape, self.shard = shape, shard
        self.first_expert, local = shard.span(shape.num_experts, "n_routed_experts")
        self.gate = Gate(shape)
        self.experts = nn.ModuleDict({
            str(e): ExpertMLP(shape.hidden_size, shape.intermediate_size, fp8_block)
            for e in range(self.first_expert, self.first_expert + local)})
        self.shared_experts = None
        if shape.num_shared_experts and shard.rank == 0:
            self.shared_experts = ExpertMLP(shape.hidden_size, shape.intermediate_size * shape.num_shared_experts,
                                            fp8_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        bias = self.gate.e_score_correction_bias
        weights, ids = route(self.gate(x), bias.float() if bias is not None else None, self.shape)
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for name, expert in self.experts.items():
            rows, slot = (ids == int(name)).nonzero(as_tuple=True)
            if rows.numel():
                contribution = expert(x[rows]).float() * weights[rows, slot][:, None]
                routed.index_add_(0, rows, contribution)
        out = (routed * self.shape.routed_scaling_factor).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.shard.all_reduce(out)
