"""Weight-streaming GEMMs for a draft step's few rows, with the work around them fused in.

A draft step at batch <= 64 multiplies a handful of activation rows by weight matrices that
do not fit in any cache: the time is the time to stream the weights once.  cuBLAS does that
well for some shapes and less well for others (measured on an H100: an lm_head of 32000 x 4096
at 0.89 of the copy bandwidth where this kernel reaches 0.97, an o projection at 0.67 vs 0.76,
bench/results/), adds split-K reduce launches, and cannot fuse what comes before or after.
This kernel streams W once and fuses the step's elementwise work:

    prologue  ROW_SCALE: x already holds x * norm_weight (the producing GEMM's SCALE_OUT), and
                         that GEMM's per-row partial sums of squares give inv_rms(row), so the
                         norm is RMSNorm(x) @ W.T = inv_rms(row) * ((x * norm_weight) @ W.T): a
                         per-row scale of the accumulator, no norm launch, no per-tile work
    epilogue  RESIDUAL:  out = residual + x @ W.T   (one rounding, as addmm with beta=1)
              SILU_MUL:  out = silu(x @ Wg.T) * (x @ Wu.T)   (W = [gate; up], rounded as torch does)
              SUMSQ_OUT: also write each row's sum of squares over this program's columns, for
                         the next GEMM's ROW_SCALE
              SCALE_OUT: also write out * norm_weight (the next norm's weight), for its ROW_SCALE
              ARGMAX_OUT: also write each row's largest (rounded) value over this program's
                         columns and its column: greedy drafting then reduces a few hundred
                         candidates per row instead of re-reading the logits

    x [m, K] (row stride free), W [N, K] row-major (K contiguous), m <= 64.

Each program owns BLOCK_N output columns of BLOCK_M rows and walks the whole K: no split-K, no
partial outputs, no second launch.  Block sizes are chosen per weight and row bucket by timing
candidates at start-up (drafter.kernels.weight_gemm.plan_gemm).  Rows to norm without the
scaled copy (a NormedInput without .scaled) are normed by a launch of their own first: norming
every x tile inside the K loop was measured slower at 32-64 rows (the lm_head at 64 rows: 108.5
us vs 93.7, bench/results/2026-11-24-h100-tma-probe) and no longer pays for its code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from drafter.kernels.fused_kernels import ArgmaxParts, rms_norm

EPILOGUE_NONE, EPILOGUE_RESIDUAL, EPILOGUE_SILU_MUL = 0, 1, 2
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
MAX_ROWS = 64  # above this the product is no longer weight-streaming: cuBLAS


@triton.jit
def _load_tile(rows, k, row_ok, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(rows + k[None, :], mask=row_ok[:, None], other=0.0)
    return tl.load(rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _mma(x, w, acc, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """acc + x @ w.T ([BLOCK_M, BLOCK_N]), or with SWAP its transpose w @ x.T ([BLOCK_N, BLOCK_M])."""
    if SWAP:  # one return: the compiler would still build a statement after a constexpr-if return
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["m", "n_parts_in"])
def skinny_gemm_kernel(
    x_ptr, stride_x,  # [m, K]; TMA: a descriptor of it, [BLOCK_M, BLOCK_K] boxes
    w_ptr, stride_w,  # [N_W, K]; SILU_MUL: [2 * N, K] = [gate; up]; TMA: a descriptor, [BLOCK_N, BLOCK_K] boxes
    out_ptr, stride_out,  # [m, N]
    res_ptr, stride_res,  # [m, N], EPILOGUE_RESIDUAL only
    sumsq_in_ptr, stride_sin, n_parts_in, eps,  # ROW_SCALE: [m, n_parts_in] f32, the norm's eps
    sumsq_out_ptr, stride_sout,  # SUMSQ_OUT: [m, cdiv(N, BLOCK_N)] f32
    amax_val_ptr, amax_idx_ptr, stride_amax,  # ARGMAX_OUT: [m, cdiv(N, BLOCK_N)] f32 and int32
    scaled_ptr, stride_scaled, scale_w_ptr,  # SCALE_OUT: [m, N] = out * scale_w, scale_w [N]
    m, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    EPILOGUE: tl.constexpr, BLOCK_P: tl.constexpr, SUMSQ_OUT: tl.constexpr,
    ARGMAX_OUT: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr,
    TMA: tl.constexpr, ROW_SCALE: tl.constexpr, SCALE_OUT: tl.constexpr, STORE_OUT: tl.constexpr,
    DTYPE: tl.constexpr,  # the activations' (and out's) dtype: every rounding point casts to it
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < m
    n_ok = offs_n < N
    dtype = DTYPE
    if not TMA:
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    if ROW_SCALE:  # layers.RMSNorm's rsqrt(mean(x^2) + eps), per row
        parts = tl.arange(0, BLOCK_P)
        ss = tl.load(sumsq_in_ptr + offs_m[:, None] * stride_sin + parts[None, :],
                     mask=m_ok[:, None] & (parts < n_parts_in)[None, :], other=0.0)
        inv_rms = tl.rsqrt(tl.sum(ss, 1) / K + eps)  # [BLOCK_M]
    if SWAP:  # the weight rows are the MMA's M side: [BLOCK_N, BLOCK_M] accumulators
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if EPILOGUE == 2:
        if not TMA:
            u_rows = w_rows + N.to(tl.int64) * stride_w
        acc_u = tl.zeros_like(acc)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        if TMA:  # the copy engine fetches the boxes; rows and columns outside the tensor read 0
            x = x_ptr.load([pid_m * BLOCK_M, k0])
            w = w_ptr.load([pid_n * BLOCK_N, k0])
        else:
            x = _load_tile(x_rows, k, m_ok, K, EVEN_K)
            w = _load_tile(w_rows, k, n_ok, K, EVEN_K)
        if DOT_F32:  # the interpreter's bf16 dot is wrong (triton 3.9); products are exact in f32 anyway
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = _mma(x, w, acc, SWAP, PRECISION)
        if EPILOGUE == 2:
            if TMA:  # a last gate block past N reads up rows: their columns are masked at the store
                wu = w_ptr.load([N + pid_n * BLOCK_N, k0])
            else:
                wu = _load_tile(u_rows, k, n_ok, K, EVEN_K)
            if DOT_F32:
                wu = wu.to(tl.float32)
            acc_u = _mma(x, wu, acc_u, SWAP, PRECISION)
    if SWAP:
        acc = tl.trans(acc)
        if EPILOGUE == 2:
            acc_u = tl.trans(acc_u)
    if ROW_SCALE:
        acc = acc * inv_rms[:, None]
        if EPILOGUE == 2:
            acc_u = acc_u * inv_rms[:, None]
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
    y = y.to(dtype)
    if STORE_OUT:  # greedy drafting keeps only the argmax candidates, not the logits
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + offs_n[None, :], y, mask=ok)
    if SCALE_OUT:  # of the stored (rounded) values, times the next norm's weight
        sw = tl.load(scale_w_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(scaled_ptr + offs_m.to(tl.int64)[:, None] * stride_scaled + offs_n[None, :],
                 (y.to(tl.float32) * sw[None, :]).to(dtype), mask=ok)
    if SUMSQ_OUT:  # of the stored (rounded) values, as the norm that reads them would compute
        yf = tl.where(ok, y.to(tl.float32), 0.0)
        tl.store(sumsq_out_ptr + offs_m * stride_sout + pid_n, tl.sum(yf * yf, 1), mask=m_ok)
    if ARGMAX_OUT:  # over the rounded values, first column on ties: torch.argmax of the stored logits
        yf = tl.where(ok, y.to(tl.float32), float("-inf"))
        col = pid_n * BLOCK_N + tl.argmax(yf, 1, tie_break_left=True)
        tl.store(amax_val_ptr + offs_m * stride_amax + pid_n, tl.max(yf, 1), mask=m_ok)
        tl.store(amax_idx_ptr + offs_m * stride_amax + pid_n, col.to(tl.int32), mask=m_ok)


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    # weight rows as the MMA's M side (acc = W_tile @ x.T): at 32 rows a row block is below the
    # H100 MMA's 64-row minimum and would waste half of each instruction
    swap: bool = False
    # x and W tiles fetched by the Hopper tensor-memory accelerator (host-built descriptors)
    # instead of per-thread loads; used where the boxes and strides allow it (tma_usable)
    tma: bool = False

    @property
    def label(self) -> str:
        flags = ("swap" if self.swap else "") + ("+tma" if self.tma else "")
        return f"{self.block_n}/{self.block_k}/{self.num_warps}/{self.num_stages}" + (f" {flags}" if flags else "")


def tma_usable(t: torch.Tensor, box_rows: int, box_cols: int) -> bool:
    """Whether a tensor-memory-accelerator descriptor can cover t [rows, cols] in boxes of
    box_rows x box_cols: boxes of at most 256 per side, 16-byte aligned base and row stride."""
    size = t.element_size()
    return (t.dim() == 2 and t.stride(1) == 1 and box_rows <= 256 and box_cols <= 256
            and box_cols * size >= 16 and t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0)


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


@dataclass
class NormedInput:
    """Rows whose RMSNorm the consuming GEMM applies on the fly: x [m, K] and the per-row
    partial sums of squares [m, parts] f32 that the GEMM producing x wrote (SUMSQ_OUT)."""
    x: torch.Tensor
    sumsq: torch.Tensor
    weight: torch.Tensor  # [K]
    eps: float
    # x * weight [m, K], when the producing GEMM wrote it (SCALE_OUT): the consumer then only
    # scales its rows (ROW_SCALE) instead of norming every tile it reads
    scaled: torch.Tensor | None = None


def skinny_gemm(
    x: torch.Tensor | NormedInput,  # [m, K]
    weight: torch.Tensor,  # [N, K]; silu_mul: [2 * N, K] = [gate; up]
    *,
    residual: torch.Tensor | None = None,  # [m, N]: out = residual + x @ W.T
    silu_mul: bool = False,
    out: torch.Tensor | None = None,  # [m, N]; may be `residual` itself (in place)
    sumsq: bool = False,  # also return the per-row partial sums of squares of out
    argmax: bool = False,  # also return the per-row argmax candidates of out (ArgmaxParts)
    scale_out: torch.Tensor | None = None,  # [N], with sumsq: also return out * scale_out (NormedInput.scaled)
    keep_out: bool = True,  # False (argmax only): out is not written, and None is returned for it
    config: GemmConfig | None = None,
):
    """-> out [m, N]; with sumsq: (out, sums of squares [m, parts] f32), and with scale_out
    (out, sums of squares, out * scale_out [m, N]); with argmax: (out, ArgmaxParts).
    A NormedInput x with .scaled is read as such: the norm is a per-row scale of the result."""
    if sumsq and argmax:
        raise ValueError("skinny_gemm: one of sumsq / argmax")
    if scale_out is not None and not sumsq:
        raise ValueError("skinny_gemm: scale_out feeds a norm, which needs sumsq too")
    if not keep_out and (not argmax or out is not None):
        raise ValueError("skinny_gemm: only the argmax candidates can stand without out")
    norm = x if isinstance(x, NormedInput) else None
    if norm is not None:
        x = norm.x
    m, k = x.shape
    n_w, k_w = weight.shape
    if k != k_w or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"skinny_gemm: x [{m}, {k}] and weight [{n_w}, {k_w}] need a shared contiguous K")
    if m > MAX_ROWS:
        raise ValueError(f"skinny_gemm: {m} rows > {MAX_ROWS}")
    n = n_w // 2 if silu_mul else n_w
    if out is None and keep_out:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"skinny_gemm: residual must be a [{m}, {n}] tensor with contiguous rows")
    if scale_out is not None and scale_out.shape != (n,):
        raise ValueError(f"skinny_gemm: scale_out must have shape [{n}]")
    cfg = config or pick_config(m, n, k, x.device, 2 if silu_mul else 1)
    row_scale = norm is not None and norm.scaled is not None
    if row_scale:
        if norm.scaled.shape != (m, k) or norm.scaled.stride(1) != 1:
            raise ValueError(f"skinny_gemm: NormedInput.scaled must be a [{m}, {k}] tensor with contiguous rows")
        x = norm.scaled
    elif norm is not None:  # no scaled copy: the norm as a launch of its own
        x, norm = rms_norm(norm.x, norm.weight, norm.eps), None
    scaled = torch.empty(m, n, dtype=x.dtype, device=x.device) if scale_out is not None else None
    parts = triton.cdiv(n, cfg.block_n)
    partial = torch.empty(m, parts, dtype=torch.float32, device=x.device) if sumsq or argmax else None
    cand = ArgmaxParts(partial, torch.empty(m, parts, dtype=torch.int32, device=x.device)) if argmax else None
    if m:
        block_m = block_m_for(m)
        epilogue = EPILOGUE_SILU_MUL if silu_mul else EPILOGUE_RESIDUAL if residual is not None else EPILOGUE_NONE
        any_out = out if keep_out else partial  # a placeholder for the pointers a variant does not read
        res = residual if residual is not None else any_out
        s_in = norm.sumsq if norm is not None else any_out
        s_out = partial if sumsq else any_out
        a_val, a_idx = (cand.values, cand.indices) if argmax else (out, out)
        sc_out, sc_w = (scaled, scale_out) if scale_out is not None else (any_out, weight)
        tma = cfg.tma and tma_usable(x, block_m, cfg.block_k) and tma_usable(weight, cfg.block_n, cfg.block_k)
        x_arg = TensorDescriptor.from_tensor(x, [block_m, cfg.block_k]) if tma else x
        w_arg = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]) if tma else weight
        skinny_gemm_kernel[(parts, triton.cdiv(m, block_m))](
            x_arg, x.stride(0), w_arg, weight.stride(0), any_out, any_out.stride(0), res, res.stride(0),
            s_in, s_in.stride(0), norm.sumsq.shape[1] if norm is not None else 0, norm.eps if norm is not None else 0.0,
            s_out, s_out.stride(0), a_val, a_idx, a_val.stride(0), sc_out, sc_out.stride(0), sc_w, m, n, k,
            BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
            EPILOGUE=epilogue,
            BLOCK_P=triton.next_power_of_2(norm.sumsq.shape[1]) if norm is not None else 1, SUMSQ_OUT=sumsq,
            ARGMAX_OUT=argmax,
            DOT_F32=x.device.type != "cuda", PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            SWAP=cfg.swap, TMA=tma, ROW_SCALE=row_scale, SCALE_OUT=scale_out is not None, STORE_OUT=keep_out,
            DTYPE=_TL_DTYPES[x.dtype], num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if argmax:
        return out, cand
    if scale_out is not None:
        return out, partial, scaled
    return (out, partial) if sumsq else out
