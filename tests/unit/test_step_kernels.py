"""The draft step's weight-streaming kernels: skinny GEMM with its epilogues and the fused greedy
hand-off (argmax + d2t + embedding + both norms).

Without a GPU they run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drafter.kernels import fused_kernels as K
from drafter.kernels.weight_gemm import ROW_BUCKETS, WeightGemm, plan_gemm
from drafter.models.layers import RMSNorm
from drafter.kernels.skinny_gemm import GemmConfig, MAX_ROWS, NormedInput, skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("m", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("k", [96, 128])  # 96: the masked K tail
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_skinny_gemm_matches_torch(m, k, epilogue):
    g = torch.Generator().manual_seed(m * 1000 + k)
    n = 80
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(2 * n if epilogue == "silu_mul" else n, k, generator=g).bfloat16()
    res = torch.randn(m, n, generator=g).bfloat16()
    exact = x.double() @ w.double().t()
    if epilogue == "residual":
        want = (exact + res.double()).bfloat16()
        got = skinny_gemm(x.to(DEVICE), w.to(DEVICE), residual=res.to(DEVICE).clone())
    elif epilogue == "silu_mul":
        gate, up = exact.bfloat16().chunk(2, dim=1)
        want = F.silu(gate) * up
        got = skinny_gemm(x.to(DEVICE), w.to(DEVICE), silu_mul=True)
    else:
        want = exact.bfloat16()
        got = skinny_gemm(x.to(DEVICE), w.to(DEVICE))
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # bf16 rounding of the result; SiLU * up sees two bf16 inputs that may each round the other way
    assert _rel(got.cpu(), want) < (2e-2 if epilogue == "silu_mul" else 1e-2)


def test_skinny_gemm_residual_in_place_and_strided_rows():
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(5, 200, generator=g).to(DEVICE)
    x = wide[:, 8:72]  # a column slice: row stride 200
    w = torch.randn(48, 64, generator=g).to(DEVICE)
    res = torch.randn(5, 48, generator=g).to(DEVICE)
    want = res + x @ w.t()
    out = skinny_gemm(x, w, residual=res, out=res)
    assert out.data_ptr() == res.data_ptr()
    torch.testing.assert_close(res, want, atol=1e-4, rtol=1e-4)


def test_tma_falls_back_where_a_descriptor_cannot_cover_the_tensor():
    """A row stride that is not 16-byte aligned (a 5-float slice) takes the per-thread loads."""
    from drafter.kernels.skinny_gemm import tma_usable

    g = torch.Generator().manual_seed(5)
    wide = torch.randn(6, 69, generator=g).to(DEVICE)
    x, w = wide[:, 2:66], torch.randn(24, 64, generator=g).to(DEVICE)
    assert not tma_usable(x, 16, 32) and tma_usable(w, 16, 32) and not tma_usable(w, 16, 512)
    got = skinny_gemm(x, w, config=GemmConfig(16, 32, 4, 1, tma=True))
    torch.testing.assert_close(got, x @ w.t(), atol=1e-4, rtol=1e-4)


def test_skinny_gemm_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="rows"):
        skinny_gemm(torch.zeros(MAX_ROWS + 1, 16), torch.zeros(8, 16))
    with pytest.raises(ValueError, match="contiguous K"):
        skinny_gemm(torch.zeros(2, 16), torch.zeros(16, 8).t())
    with pytest.raises(ValueError, match="residual"):
        skinny_gemm(torch.zeros(2, 16), torch.zeros(8, 16), residual=torch.zeros(2, 9))
    with pytest.raises(ValueError, match="scaled"):
        skinny_gemm(NormedInput(torch.zeros(2, 16), torch.ones(2, 1), torch.ones(16), 1e-5, torch.zeros(2, 8)),
                    torch.zeros(8, 16))
    with pytest.raises(ValueError, match="scale_out"):
        skinny_gemm(torch.zeros(2, 16), torch.zeros(8, 16), scale_out=torch.ones(8))  # without sumsq
    with pytest.raises(ValueError, match="argmax candidates"):
        skinny_gemm(torch.zeros(2, 16), torch.zeros(8, 16), keep_out=False)


@pytest.mark.parametrize("cfg", [GemmConfig(16, 32, 4, 1), GemmConfig(32, 64, 4, 2),
                                 GemmConfig(32, 64, 4, 2, swap=True)])
def test_skinny_gemm_block_sizes_do_not_change_the_result(cfg):
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(4, 128, generator=g).to(DEVICE), torch.randn(72, 128, generator=g).to(DEVICE)
    torch.testing.assert_close(skinny_gemm(x, w, config=cfg), x @ w.t(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [3, 33])
def test_swapped_mma_and_tma_keep_every_epilogue(m):
    """GemmConfig.swap (acc = W_tile @ x.T) and .tma (descriptor loads) change where the work
    happens, not the result: every epilogue and side output against the plain config, from plain
    rows and from rows to norm (without the scaled copy: a norm launch first; with it: a row
    scale) (K = 72: a partial last K tile, which TMA fills with zeros)."""
    g = torch.Generator().manual_seed(m)
    k, n = 72, 40
    x, res = torch.randn(m, k, generator=g).to(DEVICE), torch.randn(m, n, generator=g).to(DEVICE)
    w, w2 = torch.randn(n, k, generator=g).to(DEVICE), torch.randn(2 * n, k, generator=g).to(DEVICE)
    norm_w = torch.randn(k, generator=g).to(DEVICE)
    normed = NormedInput(x, (x * x).sum(1, keepdim=True), norm_w, 1e-5)
    prescaled = NormedInput(x, normed.sumsq, norm_w, 1e-5, x * norm_w)  # the norm as a row scale
    plain = GemmConfig(16, 32, 4, 1)
    for kw in ({"residual": res, "sumsq": True}, {"argmax": True}, {"silu_mul": True}):
        weight = w2 if kw.get("silu_mul") else w
        want, got = (skinny_gemm(inp, weight, config=plain, **kw) for inp in (normed, prescaled))
        want, got = (r if isinstance(r, tuple) else (r,) for r in (want, got))
        torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    for cfg in (GemmConfig(16, 32, 4, 1, swap=True), GemmConfig(16, 32, 4, 1, tma=True),
                GemmConfig(16, 32, 4, 1, swap=True, tma=True)):
        for inp in (x, normed, prescaled):
            for kw in ({"residual": res, "sumsq": True}, {"argmax": True}, {"silu_mul": True}):
                weight = w2 if kw.get("silu_mul") else w
                want, got = (skinny_gemm(inp, weight, config=c, **kw) for c in (plain, cfg))
                want, got = (r if isinstance(r, tuple) else (r,) for r in (want, got))
                torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
                if "argmax" in kw:
                    assert torch.equal(K.greedy_ids(got[1]), K.greedy_ids(want[1]))
                elif "sumsq" in kw:
                    torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=1e-5)


def test_weight_gemm_routes_by_bucket():
    """Rows in a planned bucket take the skinny kernel, others cuBLAS / torch: same numbers."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 32, generator=g).to(DEVICE)
    both = WeightGemm(w, plan_gemm(w, mode="on")), WeightGemm(w, plan_gemm(w, mode="off"))
    assert sorted(both[0].configs) == list(ROW_BUCKETS) and not both[1].configs
    norm_w = torch.randn(32, generator=g).to(DEVICE)
    w2_next = torch.randn(24, 40, generator=g).to(DEVICE)
    for m in (1, 20, 64, 65):
        x = torch.randn(m, 32, generator=g).to(DEVICE)
        res = torch.randn(m, 40, generator=g).to(DEVICE)
        a, b = (gemm(x) for gemm in both)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        # candidates (skinny) or logits (cuBLAS, and > 64 rows): the same greedy ids
        assert torch.equal(*(K.greedy_ids(gemm.greedy_scores(x)) for gemm in both))
        a, b = (gemm(x, residual=res) for gemm in both)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        sumsq = (x * x).sum(1, keepdim=True)  # one "part" per row
        a, b = (gemm(NormedInput(x, sumsq, norm_w, 1e-5)) for gemm in both)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        (a, sa), (b, sb) = (gemm(x, residual=res, out=res.clone(), sumsq=True) for gemm in both)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert sb is None and (sa is None) == (m > 64)
        # s = res + x @ W.T and what RMSNorm(norm_w40) hands on: x * w and sums of squares from the
        # skinny epilogue (a NormedInput), or normed rows after cuBLAS; the next GEMM reads either
        norm_w40 = torch.randn(40, generator=g).to(DEVICE)
        want_s = res + x @ w.t()
        want_next = RMSNorm(40, 1e-5).to(DEVICE).requires_grad_(False)
        want_next.weight.copy_(norm_w40)
        want_next = want_next(want_s)
        for gemm in both:
            s, handed = gemm.residual_and_norm(x, res.clone(), norm_w40, 1e-5)
            torch.testing.assert_close(s, want_s, atol=1e-4, rtol=1e-4)
            assert isinstance(handed, NormedInput) == (gemm is both[0] and m <= 64)
            nxt = WeightGemm(w2_next, plan_gemm(w2_next, mode="on"), scaled_configs=plan_gemm(w2_next, mode="on"))
            torch.testing.assert_close(nxt(handed), want_next @ w2_next.t(), atol=1e-3, rtol=1e-4)
    half = WeightGemm(w, plan_gemm(w, silu_mul=True, mode="on"))
    x = torch.randn(3, 32, generator=g).to(DEVICE)
    torch.testing.assert_close(half(x, silu_mul=True), K.silu_mul(x @ w.t()), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [1, 5, 33])
def test_sums_of_squares_feed_the_next_norm(m):
    """o GEMM (residual epilogue + partial sums of squares) -> next GEMM norming on the fly ==
    the separate steps: s = residual + x @ Wo.T; RMSNorm(s) @ Wn.T."""
    g = torch.Generator().manual_seed(m)
    x, res = torch.randn(m, 64, generator=g), torch.randn(m, 72, generator=g)
    w_o, w_n = torch.randn(72, 64, generator=g), torch.randn(40, 72, generator=g)
    norm = RMSNorm(72, 1e-5)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
    s_want = res + x @ w_o.t()
    want = norm(s_want) @ w_n.t()
    dev = [t.to(DEVICE) for t in (x, res, w_o, w_n, norm.weight.detach())]
    s, sumsq = skinny_gemm(dev[0], dev[2], residual=dev[1], sumsq=True, config=GemmConfig(16, 32, 4, 1))
    assert sumsq.shape == (m, 72 // 16 + 1)  # one partial per program along N (5 programs of 16)
    torch.testing.assert_close(sumsq.sum(1).cpu(), (s_want * s_want).sum(1), atol=1e-3, rtol=1e-5)
    got = skinny_gemm(NormedInput(s, sumsq, dev[4], 1e-5), dev[3])
    torch.testing.assert_close(s.cpu(), s_want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.cpu(), want.detach(), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("vocab", [50, 300])
@pytest.mark.parametrize("with_d2t", [False, True])
def test_greedy_embed_dual_norm_equals_its_parts(vocab, with_d2t):
    g = torch.Generator().manual_seed(vocab)
    rows, n, target_vocab = 5, 48, 400
    logits = torch.randn(rows, vocab, generator=g)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the first index wins, as torch.argmax
    d2t = torch.randint(0, target_vocab - vocab, (vocab,), generator=g) if with_d2t else None
    table = torch.randn(target_vocab, n, generator=g)
    hidden = torch.randn(rows, n, generator=g)
    norm_e, norm_h = RMSNorm(n, 1e-5), RMSNorm(n, 1e-5)
    with torch.no_grad():
        norm_e.weight.normal_(generator=g)
        norm_h.weight.normal_(generator=g)
    want_ids = logits.argmax(-1) + (d2t[logits.argmax(-1)] if with_d2t else 0)
    want = torch.cat((norm_e(table[want_ids]), norm_h(hidden)), dim=-1)
    ids, out = K.greedy_embed_dual_norm(*(t.to(DEVICE) if t is not None else None for t in (
        logits, d2t, table, hidden, norm_e.weight.detach(), norm_h.weight.detach())), 1e-5)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(out.cpu(), want.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("m", [1, 6, 40])
def test_argmax_candidates_give_torch_argmax(m):
    """The lm_head epilogue's per-block (max, column) candidates reduce to torch.argmax of the
    stored logits, ties included, for greedy_ids and for the fused hand-off."""
    g = torch.Generator().manual_seed(m)
    vocab, k, n = 200, 64, 48
    x, w = torch.randn(m, k, generator=g), torch.randn(vocab, k, generator=g)
    w[37] = w[150]  # the same logit at columns 37 and 150 (different blocks): the first must win
    x[0] = w[150] * 10  # ... and it is row 0's maximum
    dev = [t.to(DEVICE) for t in (x, w)]
    logits, parts = skinny_gemm(*dev, argmax=True, config=GemmConfig(16, 32, 4, 1))
    want = logits.cpu().argmax(-1)
    assert want[0] == 37
    assert parts.values.shape == (m, -(-vocab // 16)) and parts.indices.dtype == torch.int32
    assert torch.equal(K.greedy_ids(parts).cpu(), want)
    nothing, alone = skinny_gemm(*dev, argmax=True, keep_out=False, config=GemmConfig(16, 32, 4, 1))
    assert nothing is None  # greedy drafting: the candidates without storing the logits
    assert torch.equal(alone.values, parts.values) and torch.equal(alone.indices, parts.indices)
    d2t = torch.randint(0, 50, (vocab,), generator=g).to(DEVICE)
    assert torch.equal(K.greedy_ids(parts, d2t).cpu(), want + d2t.cpu()[want])
    table, hidden = torch.randn(260, n, generator=g).to(DEVICE), torch.randn(m, n, generator=g).to(DEVICE)
    ones = torch.ones(n, device=DEVICE)
    ids_a, out_a = K.greedy_embed_dual_norm(parts, d2t, table, hidden, ones, ones, 1e-5)
    ids_b, out_b = K.greedy_embed_dual_norm(logits, d2t, table, hidden, ones, ones, 1e-5)
    assert torch.equal(ids_a, ids_b) and torch.equal(out_a, out_b)
