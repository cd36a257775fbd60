"""Weight GEMMs over FP8 block-quantised (or plain) weights, grouped by expert, in one Triton kernel.

    out[dest[s], :] = x[rows[s], :] @ W[e(s)]^T      for every slot s with rows[s] >= 0

where slots come in blocks of BLOCK_M that all use one weight matrix e (expert_of_block; -1 = an
unused block).  dest (default: the slot itself) scatters results to compact rows, e.g. one row
per (token, expert) pair.  A dense linear is the one-expert case (rows = dest = 0 .. M-1).  FP8 weights are
dequantised tile by tile in registers: element (n, k) of expert e is
    float(W_fp8[e, n, k]) * scale_inv[e, n // BR, k // BC]
and multiplied in the activations' dtype (float32 inputs use IEEE fp32 dots) with float32
accumulation.  Where a weight tile lies inside one scale block (BLOCK_N | BR, BLOCK_K | BC, as at
128 x 128) the tile's partial product is scaled once instead of every element.  Grid and tiles depend on shapes only, so launches can be captured in CUDA graphs.
Slots of padding rows are left unwritten: callers never read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # slots per block: the smallest tile tl.dot takes


@dataclass(frozen=True)
class GemmLaunch:
    """Tile and pipeline shape of a grouped_gemm launch (None: chosen from N)."""
    block_n: int | None = None
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def grouped_gemm_kernel(
    x_ptr, stride_xm,  # [num_rows, K]
    rows_ptr,  # [num_slots] int32: the x row each slot reads, -1 = padding
    expert_ptr,  # [num_slots // BLOCK_M] int32: the weight matrix of each block of slots, -1 = unused
    w_ptr, stride_we, stride_wn,  # [E, N, K], fp8 (with scales) or the activations' dtype
    s_ptr, stride_se, stride_sn,  # [E, ceil(N / BR), ceil(K / BC)] float32 (ignored without HAS_SCALE)
    dest_ptr,  # [num_slots] int32: the output row of each slot
    out_ptr, stride_om,  # [num_out, N]
    N, K,
    BR: tl.constexpr, BC: tl.constexpr, HAS_SCALE: tl.constexpr, TILE_SCALE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block)
    if expert < 0:
        return
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + slots)
    live = rows >= 0
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + rk[None, :],
                    mask=live[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_base + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :], mask=w_mask, other=0.0)
        if TILE_SCALE:  # the tile lies in one scale block: scale the tile's partial product once
            s = tl.load(s_ptr + expert.to(tl.int64) * stride_se + (tl.program_id(1) * BLOCK_N // BR) * stride_sn
                        + k0 // BC)
            if IEEE:
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee") * s
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype))) * s
        else:
            if HAS_SCALE:
                s = tl.load(s_ptr + expert.to(tl.int64) * stride_se + (rn // BR)[:, None] * stride_sn
                            + (rk // BC)[None, :], mask=w_mask, other=0.0)
                w = w.to(tl.float32) * s
            if IEEE:
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    dest = tl.load(dest_ptr + slots)
    out = out_ptr + dest.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & n_ok[None, :])


def _block_n(n: int) -> int:
    return 32 if n <= 4096 else 64


def grouped_gemm(
    x: torch.Tensor,  # [num_rows, K]
    rows: torch.Tensor,  # [num_slots] int32, num_slots a multiple of BLOCK_M
    expert_of_block: torch.Tensor,  # [num_slots // BLOCK_M] int32
    weight: torch.Tensor,  # [E, N, K]
    scale_inv: torch.Tensor | None,  # [E, ceil(N / BR), ceil(K / BC)] float32, with fp8 weights
    block: tuple[int, int] | None,
    launch: GemmLaunch = GemmLaunch(),
    dest: torch.Tensor | None = None,  # [num_slots] int32 output row per slot (None: the slot)
    num_out: int | None = None,  # output rows when dest is given
) -> torch.Tensor:  # [num_out or num_slots, N], x's dtype; rows no live slot writes stay unwritten
    num_slots = rows.shape[0]
    if num_slots % BLOCK_M or expert_of_block.shape[0] != num_slots // BLOCK_M:
        raise ValueError(f"{num_slots} slots must come in blocks of {BLOCK_M}, one expert each")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("grouped_gemm: the K dimension must be contiguous")
    _, n, k = weight.shape
    if dest is None:
        dest, num_out = torch.arange(num_slots, dtype=torch.int32, device=x.device), num_slots
    out = torch.empty(num_out, n, dtype=x.dtype, device=x.device)
    has_scale = scale_inv is not None
    s = scale_inv if has_scale else weight  # any tensor: not read without HAS_SCALE
    br, bc = block if has_scale else (1, 1)
    block_n = launch.block_n or _block_n(n)
    block_k = 128 if k >= 128 else triton.next_power_of_2(max(k, 16))
    tile_scale = has_scale and br % block_n == 0 and bc % block_k == 0
    grid = (num_slots // BLOCK_M, triton.cdiv(n, block_n))
    grouped_gemm_kernel[grid](
        x, x.stride(0), rows, expert_of_block, weight, weight.stride(0), weight.stride(1),
        s, s.stride(0) if has_scale else 0, s.stride(1) if has_scale else 0, dest, out, out.stride(0), n, k,
        BR=br, BC=bc, HAS_SCALE=has_scale, TILE_SCALE=tile_scale, IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=launch.num_warps, num_stages=launch.num_stages)
    return out


def dense_gemm(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    scale_inv: torch.Tensor | None,  # [ceil(N / BR), ceil(K / BC)] float32, with fp8 weights
    block: tuple[int, int] | None,
) -> torch.Tensor:  # [M, N]
    """x @ W^T through the grouped kernel with one expert."""
    m = x.shape[0]
    slots = triton.cdiv(max(m, 1), BLOCK_M) * BLOCK_M
    rows = torch.arange(slots, device=x.device, dtype=torch.int32)
    rows = torch.where(rows < m, rows, -1)
    experts = torch.zeros(slots // BLOCK_M, dtype=torch.int32, device=x.device)
    scale = scale_inv[None] if scale_inv is not None else None
    return grouped_gemm(x.contiguous(), rows, experts, weight[None], scale, block, dest=rows, num_out=m)
