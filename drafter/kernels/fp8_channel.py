"""Weight GEMMs over per-output-channel FP8 weights (`--weights fp8`), dequantised in the kernel.

A weight W [N, K] is stored as float8_e4m3fn values Wq plus one float32 scale per output row s [N]:
    W[n, k] = float(Wq[n, k]) * s[n]
so x @ W.T = (x @ Wq.T) * s: each program streams its FP8 tile rows (half the bytes of bf16),
converts them to the activations' dtype in registers (exact: e4m3's 3 mantissa bits fit bf16's 7),
accumulates in float32 and scales its columns once, in the epilogue.  The epilogues are the
fused path's (drafter.kernels.skinny_gemm): a residual add, or SiLU(gate) * up over W = [gate; up]
with the same rounding points.  Rows are tiled too (BLOCK_M), so one kernel serves the draft
steps' few rows and the first pass's many; tiles are chosen per row bucket by timing candidates
at start-up on the GPU (plan_channel_gemm), and on the CPU (the Triton interpreter) the first
candidate runs.  Grid and tiles depend on shapes only: launches can be captured in CUDA graphs.

`ChannelFP8Gemm` is drafter.kernels.weight_gemm.WeightGemm's interface over this kernel (the fused
head calls either the same way); the norms that WeightGemm folds into the skinny kernel are
launches of their own here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from drafter.kernels import fused_kernels as K
from drafter.kernels.skinny_gemm import NormedInput
from drafter.kernels.weight_gemm import WeightGemm

FP8 = torch.float8_e4m3fn
EPILOGUE_NONE, EPILOGUE_RESIDUAL, EPILOGUE_SILU_MUL = 0, 1, 2
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
BIG = 128  # the row bucket of every call with more than 64 rows


@triton.jit(do_not_specialize=["m"])
def channel_fp8_gemm_kernel(
    x_ptr, stride_x,  # [m, K], the activations' dtype
    w_ptr, stride_w,  # [N_W, K] float8_e4m3fn; SILU_MUL: [2 * N, K] = [gate; up]
    s_ptr,  # [N_W] float32, one scale per weight row
    out_ptr, stride_out,  # [m, N]
    res_ptr, stride_res,  # [m, N], EPILOGUE 1 only
    m, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    EPILOGUE: tl.constexpr, SWAP: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    DTYPE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < m
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    u_rows = w_rows + N.to(tl.int64) * stride_w
    if SWAP:  # weight rows as the MMA's M side: [BLOCK_N, BLOCK_M] accumulators
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros_like(acc)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        if DOT_F32:  # the interpreter: float32 products (exact for fp8 values times the activations)
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        else:
            w = w.to(DTYPE)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if EPILOGUE == 2:
            if EVEN_K:
                wu = tl.load(u_rows + k[None, :], mask=n_ok[:, None], other=0.0)
            else:
                wu = tl.load(u_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
            if DOT_F32:
                wu = wu.to(tl.float32)
            else:
                wu = wu.to(DTYPE)
            if SWAP:
                acc_u = tl.dot(wu, tl.trans(x), acc_u, input_precision=PRECISION)
            else:
                acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=PRECISION)
    if SWAP:
        acc = tl.trans(acc)
        acc_u = tl.trans(acc_u)
    scale = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
    acc = acc * scale[None, :]  # the dequantisation: one multiply per output element
    ok = m_ok[:, None] & n_ok[None, :]
    if EPILOGUE == 1:
        res = tl.load(res_ptr + offs_m.to(tl.int64)[:, None] * stride_res + offs_n[None, :], mask=ok, other=0.0)
        y = acc + res.to(tl.float32)
    elif EPILOGUE == 2:
        scale_u = tl.load(s_ptr + N + offs_n, mask=n_ok, other=0.0)
        g = acc.to(DTYPE).to(tl.float32)  # the gate/up GEMM's output rounding, then F.silu's
        act = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
        y = act * (acc_u * scale_u[None, :]).to(DTYPE).to(tl.float32)
    else:
        y = acc
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :], y.to(DTYPE), mask=ok)


@dataclass(frozen=True)
class ChannelConfig:
    """Tile and pipeline shape of one launch."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False  # weight rows as the MMA's M side (few activation rows)

    @property
    def label(self) -> str:
        return f"{self.block_m}x{self.block_n}/{self.block_k}/{self.num_warps}/{self.num_stages}" + (
            " swap" if self.swap else "")


def bucket_of(m: int) -> int:
    """The row bucket a call of m rows is planned under: 16, 32, 64 or BIG (more than 64 rows)."""
    return BIG if m > 64 else max(16, triton.next_power_of_2(m))


# per row bucket, the first entry that fits the device's shared memory is the CPU's and the untimed GPU's
# choice (a silu_mul epilogue stages two weight tiles: some tiles fit only without it); the rest won at least
# one Llama-8B EAGLE-3 step GEMM on an H100 (bench/results/2026-11-25-h100-fp8-weights, GEMM plans)
CANDIDATES: dict[int, tuple[ChannelConfig, ...]] = {
    16: (ChannelConfig(16, 32, 512, 4, 3), ChannelConfig(16, 32, 256, 4, 4)),
    32: (ChannelConfig(32, 16, 512, 4, 3), ChannelConfig(32, 64, 256, 4, 3), ChannelConfig(32, 64, 128, 4, 5),
         ChannelConfig(32, 64, 256, 4, 4, swap=True)),
    64: (ChannelConfig(64, 32, 256, 4, 3), ChannelConfig(64, 16, 512, 4, 3), ChannelConfig(64, 32, 128, 4, 4),
         ChannelConfig(64, 64, 128, 4, 4, swap=True), ChannelConfig(64, 128, 128, 8, 3, swap=True)),
    BIG: (ChannelConfig(128, 64, 128, 8, 3), ChannelConfig(128, 128, 128, 8, 3, swap=True),
          ChannelConfig(256, 64, 64, 8, 3), ChannelConfig(256, 128, 64, 8, 3, swap=True)),
}


def channel_fp8_gemm(
    x: torch.Tensor,  # [m, K], float32 / float16 / bfloat16, contiguous K
    weight: torch.Tensor,  # [N_W, K] float8_e4m3fn; silu_mul: [2 * N, K] = [gate; up]
    scale: torch.Tensor,  # [N_W] float32
    *,
    residual: torch.Tensor | None = None,  # [m, N]: out = residual + x @ W.T
    silu_mul: bool = False,
    out: torch.Tensor | None = None,  # [m, N]; may be `residual` itself (in place)
    config: ChannelConfig | None = None,
) -> torch.Tensor:  # [m, N] (silu_mul: N = N_W / 2), x's dtype
    """x @ (Wq * s[:, None]).T with the dequantisation in the kernel's epilogue."""
    m, k = x.shape
    n_w, k_w = weight.shape
    if weight.dtype != FP8 or scale.dtype != torch.float32 or tuple(scale.shape) != (n_w,):
        raise ValueError(f"channel_fp8_gemm: weight must be float8_e4m3fn [N, K] with a float32 [N] scale, got "
                         f"{weight.dtype} {tuple(weight.shape)} and {scale.dtype} {tuple(scale.shape)}")
    if k != k_w or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"channel_fp8_gemm: x [{m}, {k}] and weight [{n_w}, {k_w}] need a shared contiguous K")
    if silu_mul and n_w % 2:
        raise ValueError(f"channel_fp8_gemm: silu_mul needs [gate; up] rows, got {n_w}")
    n = n_w // 2 if silu_mul else n_w
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if residual is not None and (tuple(residual.shape) != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"channel_fp8_gemm: residual must be a [{m}, {n}] tensor with contiguous rows")
    if not m:
        return out
    epilogue = EPILOGUE_SILU_MUL if silu_mul else EPILOGUE_RESIDUAL if residual is not None else EPILOGUE_NONE
    res = residual if residual is not None else out
    if config is not None:
        _launch(x, weight, scale, out, res, m, n, k, epilogue, config)
        return out
    fitting = _FITS.get((bucket_of(m), epilogue, x.dtype, x.device.type))
    if fitting is not None:
        _launch(x, weight, scale, out, res, m, n, k, epilogue, fitting)
        return out
    for cfg in CANDIDATES[bucket_of(m)]:  # the bucket's first candidate that fits this GPU's shared memory
        try:
            _launch(x, weight, scale, out, res, m, n, k, epilogue, cfg)
        except triton.runtime.errors.OutOfResources:
            continue
        _FITS[(bucket_of(m), epilogue, x.dtype, x.device.type)] = cfg
        return out
    raise RuntimeError(f"channel_fp8_gemm: no candidate tile of the {bucket_of(m)}-row bucket fits this device")


_FITS: dict[tuple, ChannelConfig] = {}  # (bucket, epilogue, dtype, device type) -> the default tile that compiled


def _launch(x, weight, scale, out, res, m: int, n: int, k: int, epilogue: int, cfg: ChannelConfig) -> None:
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    channel_fp8_gemm_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))](
        x, x.stride(0), weight, weight.stride(0), scale, out, out.stride(0), res, res.stride(0), m, n, k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, EPILOGUE=epilogue,
        SWAP=cfg.swap, DOT_F32=x.device.type != "cuda", PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DTYPE=_TL_DTYPES[x.dtype], num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@dataclass
class ChannelFP8Gemm(WeightGemm):
    """WeightGemm's interface over an FP8 weight [N, K] with its per-row scale [N] (`scale`).
    configs: row bucket (bucket_of) -> the launch it takes; plan_us: the start-up timings."""
    scale: torch.Tensor | None = None  # [N] float32
    configs: dict = field(default_factory=dict)  # a bucket absent: its first candidate that fits

    def __post_init__(self):
        if self.weight.dtype != FP8 or self.scale is None:
            raise ValueError("ChannelFP8Gemm needs a float8_e4m3fn weight and its float32 per-row scale")

    def _launch(self, x: torch.Tensor | NormedInput, residual=None, silu_mul=False, out=None) -> torch.Tensor:
        if isinstance(x, NormedInput):  # the norm as a launch of its own
            x = K.rms_norm(x.x, x.weight, x.eps)
        if x.stride(-1) != 1:
            x = x.contiguous()
        cfg = self.configs.get(bucket_of(x.shape[0]))
        return channel_fp8_gemm(x, self.weight, self.scale, residual=residual, silu_mul=silu_mul, out=out, config=cfg)

    def __call__(self, x, *, residual=None, silu_mul=False, out=None, sumsq=False, argmax=False):
        """As WeightGemm.__call__; the sums of squares and argmax candidates are never made here (None)."""
        y = self._launch(x, residual, silu_mul, out)
        return (y, None) if sumsq or argmax else y

    def residual_and_norm(self, x, residual, norm_weight, eps, out=None):
        """s = residual + x @ W.T [m, N], and the normed rows RMSNorm(s) for the next GEMM."""
        s = self._launch(x, residual, False, out)
        return s, K.rms_norm(s, norm_weight, eps)

    def greedy_scores(self, x) -> torch.Tensor:  # [m, N] logits
        return self._launch(x)


def plan_channel_gemm(weight: torch.Tensor, scale: torch.Tensor, *, silu_mul: bool = False, residual: bool = False,
                      dtype: torch.dtype = torch.bfloat16, timed: bool = True, timings: dict | None = None,
                      candidates: dict[int, tuple[ChannelConfig, ...]] = CANDIDATES) -> dict[int, ChannelConfig]:
    """Row bucket -> the fastest candidate launch on this GPU (CUDA-graph replays over three copies
    of the weight, so that none is read from L2), with the layer's epilogue; on the CPU, or
    without `timed` (EngineConfig.skinny_gemm other than auto) none: each bucket then takes its first
    candidate that fits (channel_fp8_gemm without a config).
    dtype: the activations'.  timings: filled with {bucket: {config label: device us}}."""
    if weight.device.type != "cuda" or not timed:
        return {}  # every bucket: its first candidate that fits this device (channel_fp8_gemm without config)
    from drafter.kernels.cuda_timing import graph_time_us

    k = weight.shape[1]
    n = weight.shape[0] // (2 if silu_mul else 1)
    copies = [weight] + [weight.clone() for _ in range(2)]
    plan = {}
    for bucket, configs in candidates.items():
        rows = 256 if bucket == BIG else bucket
        x = torch.randn(rows, k, device=weight.device, dtype=dtype)
        res = torch.randn(rows, n, device=weight.device, dtype=x.dtype) if residual else None
        seen = {}
        for cfg in configs:
            try:
                us = graph_time_us(lambda i: channel_fp8_gemm(x, copies[i % 3], scale, residual=res,
                                                              silu_mul=silu_mul, config=cfg), calls=6)
            except triton.runtime.errors.OutOfResources:  # more shared memory than this GPU has
                us = float("inf")
            seen[cfg] = us
        best = min(seen, key=seen.get)
        if seen[best] < float("inf"):  # else the bucket takes its first candidate that fits
            plan[bucket] = best
        if timings is not None:
            timings[bucket] = {c.label: us for c, us in seen.items()}
    return plan
