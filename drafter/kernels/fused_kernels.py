"""Triton kernels that fuse a draft layer's elementwise work (norms, residual adds, SiLU).

At small batch a draft step is a handful of weight-streaming GEMMs; everything else is
launch overhead, one kernel per torch op.  These kernels cut that to one launch per stage.
Each reproduces the rounding of the torch code it replaces (drafter.models.layers): results
are cast to the activation dtype exactly where torch casts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _rms(x, w_ptr, cols, ok, n_cols, eps, DTYPE: tl.constexpr):
    """layers.RMSNorm on one f32 row: (x * rsqrt(mean(x^2) + eps)).to(dtype) * weight."""
    r = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return (x * r).to(DTYPE).to(tl.float32) * w


@triton.jit
def rms_norm_kernel(
    x_ptr, stride_x,  # [rows, n_cols]
    res_ptr, stride_res,  # [rows, n_cols], HAS_RES only
    w_ptr,  # [n_cols]
    out_ptr, stride_out,  # [rows, n_cols]: norm(x (+ res))
    sum_ptr, stride_sum,  # [rows, n_cols], HAS_RES only: x + res, the new residual stream
    n_cols, eps,
    BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
        x = x.to(dtype)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
        x = x.to(tl.float32)
    y = _rms(x, w_ptr, cols, ok, n_cols, eps, dtype)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_dual_norm_half(half, tok, row, table_ptr, stride_table, hidden_ptr, stride_hidden, w_embed_ptr,
                          w_hidden_ptr, out_ptr, stride_out, n_cols, eps, BLOCK: tl.constexpr):
    """One half of EAGLE-3's layer input row: half 0 = norm(embedding of tok), half 1 = norm(hidden)."""
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    dtype = hidden_ptr.dtype.element_ty
    if half == 0:
        x = tl.load(table_ptr + tok * stride_table + cols, mask=ok, other=0.0).to(tl.float32)
        y = _rms(x, w_embed_ptr, cols, ok, n_cols, eps, dtype)
    else:
        x = tl.load(hidden_ptr + row * stride_hidden + cols, mask=ok, other=0.0).to(tl.float32)
        y = _rms(x, w_hidden_ptr, cols, ok, n_cols, eps, dtype)
    tl.store(out_ptr + row * stride_out + half * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def embed_dual_norm_kernel(
    ids_ptr,  # [rows] int: token ids
    table_ptr, stride_table,  # [vocab, n_cols] embedding
    hidden_ptr, stride_hidden,  # [rows, n_cols]
    w_embed_ptr, w_hidden_ptr,  # [n_cols] each
    out_ptr, stride_out,  # [rows, 2 * n_cols]: [norm(embed(ids)) | norm(hidden)]
    n_cols, eps,
    BLOCK: tl.constexpr,
):
    """EAGLE-3's layer input: the embedding gather and both norms in one launch."""
    row = tl.program_id(0).to(tl.int64)
    half = tl.program_id(1)
    tok = tl.load(ids_ptr + row, mask=half == 0, other=0).to(tl.int64)
    _store_dual_norm_half(half, tok, row, table_ptr, stride_table, hidden_ptr, stride_hidden, w_embed_ptr,
                          w_hidden_ptr, out_ptr, stride_out, n_cols, eps, BLOCK)


@triton.jit
def silu_mul_kernel(
    x_ptr, stride_x,  # [rows, 2 * n_cols]: gate | up
    out_ptr, stride_out,  # [rows, n_cols]
    n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # F.silu rounds to the dtype
    tl.store(out_ptr + row * stride_out + cols, (act * u).to(out_ptr.dtype.element_ty), mask=ok)


def _norm_launch(n_cols: int) -> dict:
    block = triton.next_power_of_2(n_cols)
    return dict(BLOCK=block, num_warps=max(1, min(16, block // 256)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None):
    """norm(x) -> out; with residual: s = x + residual, returns (norm(s), s).
    x, residual: [rows, n]; weight: [n]; out: [rows, n], may be a column slice of a wider buffer."""
    rows, n = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    if out is None:
        out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else out
    if rows:
        res = residual if residual is not None else x
        rms_norm_kernel[(rows,)](x, x.stride(0), res, res.stride(0), weight, out, out.stride(0),
                                 total, total.stride(0), n, eps, HAS_RES=residual is not None,
                                 **_norm_launch(n))
    return out if residual is None else (out, total)


def embed_dual_norm(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, w_embed: torch.Tensor,
                    w_hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """[norm_e(table[ids]) | norm_h(hidden)]: ids [rows], table [vocab, n], hidden [rows, n] -> [rows, 2n]."""
    rows, n = hidden.shape
    ids = ids.contiguous()
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    out = torch.empty(rows, 2 * n, dtype=hidden.dtype, device=hidden.device)
    if rows:
        embed_dual_norm_kernel[(rows, 2)](ids, table, table.stride(0), hidden, hidden.stride(0), w_embed, w_hidden,
                                          out, out.stride(0), n, eps, **_norm_launch(n))
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up]: [rows, 2n] -> [rows, n]."""
    rows, two_n = x.shape
    n = two_n // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        # ~14 programs per row at Llama-8B's 14336: a one-row step should not wait on one SM
        block = min(1024, triton.next_power_of_2(n))
        silu_mul_kernel[(rows, triton.cdiv(n, block))](x, x.stride(0), out, out.stride(0), n, BLOCK=block,
                                                       num_warps=4)
    return out


@triton.jit
def _row_argmax(row_ptr, vocab, BLOCK: tl.constexpr):
    """First index of the row's maximum (torch.argmax's tie rule), int32."""
    cols = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(row_ptr + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        i = tl.argmax(x, 0, tie_break_left=True) + start
        better = m > best  # strict: an earlier chunk keeps a tie
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, m, best)
    return best_i


@dataclass
class ArgmaxParts:
    """Per-row argmax candidates that a GEMM epilogue left behind, one per column block:
    values [rows, parts] f32 (the block's largest rounded logit) and indices [rows, parts] int32
    (its column, the first on ties).  The row's argmax is the first part holding the maximum."""
    values: torch.Tensor
    indices: torch.Tensor


@triton.jit
def _greedy_token(scores_ptr, stride_s, idx_ptr, stride_idx, row, n, d2t_ptr,
                  BLOCK: tl.constexpr, FROM_PARTS: tl.constexpr, HAS_D2T: tl.constexpr):
    """Target-vocabulary id of row's argmax, from logits [rows, n] or ArgmaxParts ([rows, n] each)."""
    j = _row_argmax(scores_ptr + row * stride_s, n, BLOCK)
    if FROM_PARTS:
        tok = tl.load(idx_ptr + row * stride_idx + j).to(tl.int64)
    else:
        tok = j.to(tl.int64)
    if HAS_D2T:
        tok += tl.load(d2t_ptr + tok)
    return tok


@triton.jit
def greedy_ids_kernel(
    scores_ptr, stride_s,  # [rows, n]: logits (n = vocab) or ArgmaxParts.values (n = parts)
    idx_ptr, stride_idx,  # [rows, n] int32: ArgmaxParts.indices (FROM_PARTS)
    d2t_ptr,  # [vocab] int64 offsets to target ids (HAS_D2T)
    out_ptr,  # [rows] int64: target-vocabulary ids
    n,
    BLOCK: tl.constexpr, FROM_PARTS: tl.constexpr, HAS_D2T: tl.constexpr,
):
    """argmax over the row (first index on ties, as torch.argmax), mapped to the target vocabulary."""
    row = tl.program_id(0).to(tl.int64)
    tl.store(out_ptr + row, _greedy_token(scores_ptr, stride_s, idx_ptr, stride_idx, row, n, d2t_ptr,
                                          BLOCK, FROM_PARTS, HAS_D2T))


def _argmax_launch(n: int) -> dict:
    # one load covers the 32000-token draft vocabularies; a 128k vocabulary takes 4 rounds
    block = min(32768, triton.next_power_of_2(n))
    return dict(BLOCK=block, num_warps=16 if block >= 8192 else 4)


def _scores(logits: torch.Tensor | ArgmaxParts):
    """(scores [rows, n], indices or scores again, FROM_PARTS) for the greedy kernels."""
    if isinstance(logits, ArgmaxParts):
        return logits.values, logits.indices, True
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return logits, logits, False


def greedy_ids(logits: torch.Tensor | ArgmaxParts, d2t: torch.Tensor | None = None) -> torch.Tensor:
    """Target ids of the argmax of each row: logits [rows, vocab] (or their ArgmaxParts) -> [rows] int64
    (+ d2t[id] if given)."""
    scores, idx, parts = _scores(logits)
    rows, n = scores.shape
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows:
        greedy_ids_kernel[(rows,)](scores, scores.stride(0), idx, idx.stride(0), d2t if d2t is not None else out,
                                   out, n, FROM_PARTS=parts, HAS_D2T=d2t is not None, **_argmax_launch(n))
    return out


@triton.jit
def greedy_embed_dual_norm_kernel(
    scores_ptr, stride_s,  # [rows, n]: logits or ArgmaxParts.values
    idx_ptr, stride_idx,  # [rows, n] int32: ArgmaxParts.indices (FROM_PARTS)
    d2t_ptr,  # [vocab] int64 (HAS_D2T)
    ids_ptr,  # [rows] int64 out: target-vocabulary ids
    table_ptr, stride_table,  # [target_vocab, n_cols] embedding
    hidden_ptr, stride_hidden,  # [rows, n_cols]
    w_embed_ptr, w_hidden_ptr,  # [n_cols] each
    out_ptr, stride_out,  # [rows, 2 * n_cols]: [norm(embed(ids)) | norm(hidden)]
    n, n_cols, eps,
    BLOCK_V: tl.constexpr, BLOCK: tl.constexpr, FROM_PARTS: tl.constexpr, HAS_D2T: tl.constexpr,
):
    """One greedy chain hand-off: argmax (+ d2t) of the logits, then EAGLE-3's next layer input
    (the new token's embedding and the carried hidden state, each normed), in one launch."""
    row = tl.program_id(0).to(tl.int64)
    half = tl.program_id(1)
    tok = tl.zeros([], tl.int64)
    if half == 0:
        tok = _greedy_token(scores_ptr, stride_s, idx_ptr, stride_idx, row, n, d2t_ptr, BLOCK_V, FROM_PARTS,
                            HAS_D2T)
        tl.store(ids_ptr + row, tok)
    _store_dual_norm_half(half, tok, row, table_ptr, stride_table, hidden_ptr, stride_hidden, w_embed_ptr,
                          w_hidden_ptr, out_ptr, stride_out, n_cols, eps, BLOCK)


def greedy_embed_dual_norm(logits: torch.Tensor | ArgmaxParts, d2t: torch.Tensor | None, table: torch.Tensor,
                           hidden: torch.Tensor, w_embed: torch.Tensor, w_hidden: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy_ids(logits, d2t), embed_dual_norm(those ids, ...)) in one launch.
    logits [rows, vocab] (or their ArgmaxParts), table [target_vocab, n], hidden [rows, n]
    -> ids [rows] int64, [rows, 2n]."""
    scores, idx, parts = _scores(logits)
    rows, n_scores = scores.shape
    n = hidden.shape[1]
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    ids = torch.empty(rows, dtype=torch.int64, device=hidden.device)
    out = torch.empty(rows, 2 * n, dtype=hidden.dtype, device=hidden.device)
    if rows:
        launch = _argmax_launch(n_scores)
        greedy_embed_dual_norm_kernel[(rows, 2)](
            scores, scores.stride(0), idx, idx.stride(0), d2t if d2t is not None else ids, ids, table,
            table.stride(0), hidden, hidden.stride(0), w_embed, w_hidden, out, out.stride(0), n_scores, n, eps,
            BLOCK_V=launch["BLOCK"], BLOCK=triton.next_power_of_2(n), FROM_PARTS=parts, HAS_D2T=d2t is not None,
            num_warps=max(4, launch["num_warps"]))
    return ids, out
