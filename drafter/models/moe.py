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
Why an all-reduce and not an all-to-all dispatch: under tensor parallelism every rank already
holds every token's hidden state (attention's o_proj ends in an all-reduce), so sending tokens to
their experts' ranks would move data the ranks already have; a draft step's batch is at most a
few hundred tokens, so the one [tokens, hidden] all-reduce is small (64 x 7168 bf16 = 0.9 MB).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from drafter.models.deepseek_config import MoEShape
from drafter.models.fp8 import FP8Linear, make_linear
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


def plan_slots(
    ids: torch.Tensor,  # [num_tokens, top_k] global expert ids
    first: int,
    num_local: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay the (token, expert) pairs of this rank's experts out for the grouped kernel: each expert
    gets a run of whole blocks of block_m slots.  Returns (token row of each slot [S] int32, -1 =
    padding; the pair (flat index into ids) of each slot [S] int64; the expert of each block
    [S / block_m] int32, -1 = unused), S = the static worst case, computed without host reads."""
    pairs = ids.numel()
    slots = -(-(pairs + num_local * (block_m - 1)) // block_m) * block_m
    local = ids.flatten() - first
    key = torch.where((local >= 0) & (local < num_local), local, num_local)  # other ranks' experts: bucket E
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=ids.device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    seg_end = padded.cumsum(0)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    mine = sorted_key < num_local
    e = sorted_key.clamp(max=num_local - 1)
    rank_in_expert = torch.arange(pairs, device=ids.device) - (counts.cumsum(0) - counts)[e]
    slot = torch.where(mine, seg_end[e] - padded[e] + rank_in_expert, slots)  # others: a spare slot
    rows = torch.full((slots + 1,), -1, dtype=torch.int32, device=ids.device)
    rows.scatter_(0, slot, torch.where(mine, order // ids.shape[1], -1).to(torch.int32))
    pair_of_slot = torch.full((slots + 1,), -1, dtype=torch.long, device=ids.device)
    pair_of_slot.scatter_(0, slot, torch.where(mine, order, -1))
    block_starts = torch.arange(0, slots, block_m, device=ids.device)
    expert = torch.searchsorted(seg_end, block_starts, right=True)
    expert_of_block = torch.where(expert < num_local, expert, -1).to(torch.int32)
    return rows[:slots], pair_of_slot[:slots], expert_of_block


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
        self.stacked: dict | None = None  # per projection (weights, scales, block) once stack_experts() ran

    def stack_experts(self) -> None:
        """Hold each projection of the local experts as one [E, out, in] tensor (the experts'
        modules become views into it) and run the routed experts through the grouped kernel."""
        experts = list(self.experts.values())
        self.stacked = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            layers = [getattr(e, proj) for e in experts]
            weight = torch.stack([m.weight.data for m in layers])
            scale = torch.stack([m.weight_scale_inv for m in layers]) if isinstance(layers[0], FP8Linear) else None
            for i, m in enumerate(layers):
                if scale is None:
                    m.weight.data = weight[i]
                else:
                    m.weight, m.weight_scale_inv = weight[i], scale[i]
            self.stacked[proj] = (weight, scale, layers[0].block if scale is not None else None)

    def _routed_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights_k * expert_{ids_k}(x) through three grouped kernel launches, [n, hidden] float32.
        The launches write one row per (token, expert) pair, so the elementwise work and the sum
        over k touch n * top_k rows, not the padded slots."""
        from drafter.kernels.fp8_gemm import BLOCK_M, grouped_gemm

        n, k = ids.shape
        rows, pair, expert_of_block = plan_slots(ids, self.first_expert, len(self.experts), BLOCK_M)
        pair = pair.to(torch.int32)
        x = x.contiguous()
        gate = grouped_gemm(x, rows, expert_of_block, *self.stacked["gate_proj"], dest=pair, num_out=n * k)
        up = grouped_gemm(x, rows, expert_of_block, *self.stacked["up_proj"], dest=pair, num_out=n * k)
        y = grouped_gemm(F.silu(gate) * up, pair, expert_of_block, *self.stacked["down_proj"], dest=pair,
                         num_out=n * k)  # [n * k, hidden]; other ranks' pairs unwritten
        local = ids.flatten() - self.first_expert
        mine = (local >= 0) & (local < len(self.experts))
        contribution = torch.where(mine[:, None], y.float() * weights.flatten()[:, None], 0.0)
        return contribution.view(n, k, -1).sum(dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        bias = self.gate.e_score_correction_bias
        weights, ids = route(self.gate(x), bias.float() if bias is not None else None, self.shape)
        if self.stacked is not None:
            return self._finish(self._routed_grouped(x, weights, ids), x)
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for name, expert in self.experts.items():
            rows, slot = (ids == int(name)).nonzero(as_tuple=True)
            if rows.numel():
                contribution = expert(x[rows]).float() * weights[rows, slot][:, None]
                routed.index_add_(0, rows, contribution)
        return self._finish(routed, x)

    def _finish(self, routed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [n, hidden]
        """routed_scaling_factor on the routed sum, the shared experts added, ranks summed."""
        out = (routed * self.shape.routed_scaling_factor).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.shard.all_reduce(out)
