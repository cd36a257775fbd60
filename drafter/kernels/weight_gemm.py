"""One weight matrix's GEMM on the fused path: drafter's skinny kernel or cuBLAS, per row bucket.

    gemm = WeightGemm(weight, plan_gemm(weight, silu_mul=True, normed=True))
    act = gemm(NormedInput(x, sumsq, norm_weight, eps), silu_mul=True)   # [m, N / 2]

`plan_gemm` times, at start-up and on this device, cuBLAS against a few block-size candidates of
the skinny kernel for each row bucket, with the same fused work on both sides (cuBLAS: the norm
kernel before, the SiLU kernel after, addmm for the residual), and keeps the fastest.  Device
time comes from CUDA-graph replays over three copies of the weight, so that no candidate finds
the weights in L2.  On the CPU (tests, under the Triton interpreter) every bucket takes the
skinny kernel, so CI covers it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton

from drafter.kernels.cuda_timing import graph_time_us
from drafter.kernels import fused_kernels as K
from drafter.kernels.skinny_gemm import MAX_ROWS, GemmConfig, NormedInput, block_m_for, pick_config, skinny_gemm

ROW_BUCKETS = (16, 32, 64)  # the skinny kernel's row-block sizes: one decision per bucket
# (block_n, block_k, warps, stages[, swap, tma]): the fastest configurations of H100 sweeps over
# the Llama-8B step shapes (bench/probe_step_gemms.py 2026-11-22; bench/probe_plan.py and
# bench/probe_tma_gemm.py 2026-11-24: wide tiles with the norm as its own launch beat cuBLAS on
# gate/up and the lm_head at 64 rows, the swapped MMA and TMA loads win at 32 rows); timing picks
# among them per weight.  A NormedInput without .scaled (probes and tests: fuse_head never hands
# one on) is normed by a launch of its own before the skinny kernel.
_SWAP, _SWAP_TMA, _TMA = dict(swap=True), dict(swap=True, tma=True), dict(tma=True)
CANDIDATES = {
    16: (GemmConfig(32, 256, 4, 3), GemmConfig(64, 256, 4, 3), GemmConfig(32, 512, 4, 3),
         GemmConfig(64, 256, 4, 3, **_SWAP), GemmConfig(128, 128, 8, 4, **_SWAP), GemmConfig(64, 256, 4, 3, **_SWAP_TMA)),
    32: (GemmConfig(32, 128, 4, 3), GemmConfig(64, 128, 4, 3), GemmConfig(32, 128, 4, 6),
         GemmConfig(64, 128, 4, 6, **_SWAP), GemmConfig(128, 128, 4, 4, **_SWAP), GemmConfig(64, 128, 4, 6, **_SWAP_TMA),
         GemmConfig(128, 128, 8, 3, **_SWAP_TMA), GemmConfig(128, 128, 4, 4, **_SWAP_TMA)),
    64: (GemmConfig(32, 128, 4, 3), GemmConfig(64, 128, 4, 3), GemmConfig(32, 128, 4, 6), GemmConfig(64, 128, 4, 6),
         GemmConfig(64, 128, 4, 6, **_SWAP), GemmConfig(128, 128, 8, 3), GemmConfig(64, 128, 4, 6, **_TMA),
         GemmConfig(64, 128, 4, 6, **_SWAP_TMA), GemmConfig(128, 128, 8, 3, **_TMA), GemmConfig(128, 128, 4, 4, **_SWAP_TMA)),
}


@dataclass
class WeightGemm:
    """x @ weight.T for one weight [N, K]: the skinny kernel with configs[bucket] for the row
    buckets it names, cuBLAS (and separate norm / SiLU launches) for the rest and for > 64 rows.
    Either way the same function, up to the GEMM's summation order.  A NormedInput without
    .scaled (normed by a launch of its own first) also takes configs."""
    weight: torch.Tensor  # [N, K]; silu_mul: [2 * N', K] = [gate; up]
    configs: dict[int, GemmConfig] = field(default_factory=dict)
    plan_us: dict = field(default_factory=dict, repr=False)  # plan_gemm's timings, for diagnostics
    # for a NormedInput that carries .scaled (the norm is then a row scale of the result):
    # plan_gemm(..., prescaled=True); a bucket absent here takes cuBLAS after a norm launch
    scaled_configs: dict[int, GemmConfig] = field(default_factory=dict)

    def _config(self, x: torch.Tensor | NormedInput) -> GemmConfig | None:
        rows = x.x if isinstance(x, NormedInput) else x
        m = rows.shape[0]
        if m > MAX_ROWS or rows.stride(1) != 1:
            return None
        prescaled = isinstance(x, NormedInput) and x.scaled is not None
        return (self.scaled_configs if prescaled else self.configs).get(block_m_for(m))

    def __call__(self, x: torch.Tensor | NormedInput, *, residual: torch.Tensor | None = None,
                 silu_mul: bool = False, out: torch.Tensor | None = None, sumsq: bool = False,
                 argmax: bool = False):
        """x [m, K] (or rows to norm first) -> out [m, N] (silu_mul: [m, N / 2]), or with sumsq
        (out, per-row partial sums of squares of out or None), or with argmax (out, ArgmaxParts or
        None).  residual [m, N] is added; out may be residual itself."""
        cfg = self._config(x)
        if cfg is not None:
            return skinny_gemm(x, self.weight, residual=residual, silu_mul=silu_mul, out=out, sumsq=sumsq,
                               argmax=argmax, config=cfg)
        if isinstance(x, NormedInput):
            x = K.rms_norm(x.x, x.weight, x.eps)
        if residual is not None:
            y = residual.addmm_(x, self.weight.t()) if out is residual else torch.addmm(
                residual, x, self.weight.t(), out=out)
        else:
            y = F.linear(x, self.weight)
            y = K.silu_mul(y) if silu_mul else y
            if out is not None:
                y = out.copy_(y)
        return (y, None) if sumsq or argmax else y

    def residual_and_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          out: torch.Tensor | None = None):
        """s = residual + x @ W.T [m, N], and what the RMSNorm(norm_weight, eps) that follows it
        hands the next GEMM: a NormedInput with the sums of squares and s * norm_weight from the
        skinny kernel's epilogue, or (after cuBLAS) the normed rows.  out may be residual."""
        cfg = self._config(x)
        if cfg is None:
            s = self(x, residual=residual, out=out)
            return s, K.rms_norm(s, norm_weight, eps)
        s, sumsq, scaled = skinny_gemm(x, self.weight, residual=residual, out=out, sumsq=True,
                                       scale_out=norm_weight, config=cfg)
        return s, NormedInput(s, sumsq, norm_weight, eps, scaled)

    def greedy_scores(self, x: torch.Tensor | NormedInput) -> torch.Tensor | K.ArgmaxParts:
        """What the greedy kernels reduce for x @ weight.T: the skinny kernel's per-block argmax
        candidates, or the logits [m, N] where cuBLAS made them."""
        cfg = self._config(x)
        if cfg is not None:  # the candidates alone: the logits are not stored
            return skinny_gemm(x, self.weight, argmax=True, keep_out=False, config=cfg)[1]
        logits, _ = self(x, argmax=True)
        return logits


def plan_gemm(weight: torch.Tensor, *, silu_mul: bool = False, residual: bool = False, normed: bool = False,
              prescaled: bool = False, argmax: bool = False, mode: str = "auto", timings: dict | None = None,
              candidates: dict[int, tuple[GemmConfig, ...]] = CANDIDATES) -> dict[int, GemmConfig]:
    """Row bucket -> skinny config, for the buckets where the skinny kernel is faster here.
    The candidates run the GEMM as the layer will: with its residual (and what the next norm
    needs, residual_and_norm) or its SiLU, from normed input when `normed` (and `prescaled`: input that carries x * weight,
    WeightGemm.scaled_configs).  mode "on": every bucket, "off": none.
    timings: filled with {bucket: {"cublas" or the config: device us}} (diagnostics).
    candidates: the skinny configs to time per bucket (probes try others)."""
    if mode == "off":
        return {}
    n, k = weight.shape[0] // (2 if silu_mul else 1), weight.shape[1]
    if mode == "on" or weight.device.type != "cuda":
        return {b: pick_config(b, n, k, weight.device, 2 if silu_mul else 1) for b in ROW_BUCKETS}
    copies = [weight] + [weight.clone() for _ in range(2)]
    plan = {}
    for bucket in ROW_BUCKETS:
        x = torch.randn(bucket, k, device=weight.device, dtype=weight.dtype)
        inp = NormedInput(x, torch.rand(bucket, 8, device=x.device) * k, torch.ones(k, device=x.device, dtype=x.dtype),
                          1e-5, x.clone() if prescaled else None) if normed else x
        res = torch.randn(bucket, n, device=weight.device, dtype=weight.dtype) if residual else None
        norm_w = torch.ones(n, device=weight.device, dtype=weight.dtype)

        def time_of(configs):
            gemms = [WeightGemm(w, configs, scaled_configs=configs) for w in copies]  # either input kind
            try:
                return graph_time_us(lambda i: _as_layer_runs_it(gemms[i % 3], inp, res, silu_mul, argmax, norm_w),
                                     calls=6)
            except triton.runtime.errors.OutOfResources:  # more shared memory than this GPU has
                return float("inf")

        best, best_us = None, time_of({})
        seen = {"cublas": best_us}
        for cfg in candidates[bucket]:
            us = seen[cfg] = time_of({bucket: cfg})
            if us < best_us:
                best, best_us = cfg, us
        if best is not None:
            plan[bucket] = best
        if timings is not None:
            timings[bucket] = seen
    return plan


def _as_layer_runs_it(gemm: WeightGemm, x, residual, silu_mul: bool, argmax: bool, norm_w=None):
    """One call with the work each path brings along: after the lm_head the greedy argmax (over
    the logits, or the skinny kernel's candidates); a residual GEMM as the layer calls it,
    residual_and_norm (the skinny epilogue's sums of squares and scaled rows, or after cuBLAS the
    norm as a launch of its own)."""
    if argmax:
        return K.greedy_ids(gemm.greedy_scores(x))
    if residual is not None:
        return gemm.residual_and_norm(x, residual, norm_w, 1e-5)
    return gemm(x, silu_mul=silu_mul)
