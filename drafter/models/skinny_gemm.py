"""Weight-streaming GEMMs for a draft step's few rows, with the elementwise work fused in.

A draft step at batch <= 64 multiplies a handful of activation rows by weight matrices that
do not fit in any cache: the time is the time to stream the weights once.  cuBLAS does that
well for some shapes and poorly for others (a 28672-row gate/up matrix at one row ran on 112 of
132 SMs of an H200, 84% of the copy bandwidth; its split-K choices add a reduce launch), and it
cannot fuse what follows.  This kernel streams W once with a grid sized to the device and
applies the step's epilogue before the single store:

    out = x @ W.T                          EPILOGUE_NONE
    out = residual + x @ W.T               EPILOGUE_RESIDUAL  (one rounding, as addmm with beta=1)
    out = silu(x @ Wg.T) * (x @ Wu.T)      EPILOGUE_SILU_MUL  (W = [gate; up], rounded as torch does)

    x [m, K] (row stride free), W [N, K] row-major (K contiguous), m <= 64.

Each program owns BLOCK_N output columns of BLOCK_M rows and walks the whole K: no split-K, so
no partial sums and no second launch.  The block sizes per shape come from `pick_config`
(measured on an H100 and an H200: bench/results/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

EPILOGUE_NONE, EPILOGUE_RESIDUAL, EPILOGUE_SILU_MUL = 0, 1, 2
MAX_ROWS = 64  # above this the product is no longer weight-streaming: cuBLAS


@triton.jit(do_not_specialize=["m"])
def skinny_gemm_kernel(
    x_ptr, stride_x,  # [m, K]
    w_ptr, stride_w,  # [N_W, K]; SILU_MUL: [2 * N, K] = [gate; up]
    out_ptr, stride_out,  # [m, N]
    res_ptr, stride_res,  # [m, N], EPILOGUE_RESIDUAL only
    m, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    EPILOGUE: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if EPILOGUE == 2:
        u_rows = w_rows + N.to(tl.int64) * stride_w
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        if DOT_F32:  # the interpreter's bf16 dot is wrong (triton 3.9); products are exact in f32 anyway
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        if EPILOGUE == 2:
            if EVEN_K:
                wu = tl.load(u_rows + k[None, :], mask=n_ok[:, None], other=0.0)
            else:
                wu = tl.load(u_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
            if DOT_F32:
                wu = wu.to(tl.float32)
            acc_u += tl.dot(x, tl.trans(wu), input_precision=PRECISION)
    dtype = out_ptr.dtype.element_ty
    ok = m_ok[:, None] & n_ok[None, :]
    if EPILOGUE == 1:
        res = tl.load(res_ptr + offs_m.to(tl.int64)[:, None] * stride_res + offs_n[None, :], mask=ok, other=0.0)
        y = acc + res.to(tl.float32)
    elif EPILOGUE == 2:
        g = acc.to(dtype).to(tl.float32)  # the gate/up GEMM's output rounding, then F.silu's
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        y = act * acc_u.to(dtype).to(tl.float32)
    else:
        y = acc
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :], y.to(dtype), mask=ok)


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


def block_m_for(m: int) -> int:
    return max(16, triton.next_power_of_2(m))  # tl.dot needs 16 rows; padded rows load nothing


def pick_config(m: int, n: int, k: int, device: torch.device, weight_tiles: int = 1) -> GemmConfig:
    """Block sizes for an m x n x k product: enough programs to keep every SM streaming (two
    per SM where the columns allow), and as many pipeline stages as ~96 KB of shared memory holds
    (weight_tiles: weight rows per output column, 2 for SiLU * up)."""
    if device.type != "cuda":
        return GemmConfig(block_n=16, block_k=min(64, triton.next_power_of_2(k)), num_warps=4, num_stages=1)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    block_m = block_m_for(m)
    block_k = min(256 if block_m <= 16 else 128, triton.next_power_of_2(k))
    stage_bytes = (block_m + weight_tiles * block_n) * block_k * 2
    return GemmConfig(block_n=block_n, block_k=block_k, num_stages=max(2, min(4, (96 << 10) // stage_bytes)))


def skinny_gemm(
    x: torch.Tensor,  # [m, K]
    weight: torch.Tensor,  # [N, K]; silu_mul: [2 * N, K] = [gate; up]
    *,
    residual: torch.Tensor | None = None,  # [m, N]: out = residual + x @ W.T
    silu_mul: bool = False,
    out: torch.Tensor | None = None,  # [m, N]
    config: GemmConfig | None = None,
) -> torch.Tensor:  # [m, N]
    m, k = x.shape
    n_w, k_w = weight.shape
    if k != k_w or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"skinny_gemm: x [{m}, {k}] and weight [{n_w}, {k_w}] need a shared contiguous K")
    if m > MAX_ROWS:
        raise ValueError(f"skinny_gemm: {m} rows > {MAX_ROWS}")
    n = n_w // 2 if silu_mul else n_w
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"skinny_gemm: residual must be a [{m}, {n}] tensor with contiguous rows")
    if m == 0:
        return out
    cfg = config or pick_config(m, n, k, x.device, 2 if silu_mul else 1)
    block_m = block_m_for(m)
    epilogue = EPILOGUE_SILU_MUL if silu_mul else EPILOGUE_RESIDUAL if residual is not None else EPILOGUE_NONE
    res = residual if residual is not None else out
    skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m))](
        x, x.stride(0), weight, weight.stride(0), out, out.stride(0), res, res.stride(0), m, n, k,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        EPILOGUE=epilogue, DOT_F32=x.device.type != "cuda",
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
