"""On a GPU: the per-channel FP8 GEMM kernel (--weights fp8) against the dequantise-then-matmul
reference, at Llama-8B step shapes and every candidate tile; and a fused FP8 engine's drafts
against the eager FP8 engine's.

Run on a GPU host:  pytest -m gpu tests/gpu/test_fp8_channel.py
Elsewhere every test here is skipped with a message (CI has no GPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU host"),
]

CUDA = "cuda"


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _fp8_capable() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("rows", [1, 33, 64, 256])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_channel_kernel_matches_the_dequantised_reference_for_every_candidate(rows, epilogue):
    """bf16 activations, an FP8 weight of 4096 rows (or 2 x 1792 gate/up rows) over K = 4096: every
    candidate tile of the row bucket gives the reference's result within bf16 rounding of the output
    (rel. error <= 1e-2; the reference rounds the dequantised weight to bf16, the kernel multiplies
    the exact fp8 values and scales in float32); a ragged K = 4000 with the bucket's default tile
    (without an epilogue: every compile here costs a cold machine a second or two)."""
    if not _fp8_capable():
        pytest.skip("float8_e4m3fn needs compute capability >= 8.9")
    import triton

    from drafter.kernels.fp8_channel import CANDIDATES, bucket_of, channel_fp8_gemm
    from drafter.models.fp8 import dequantize_rows, quantize_rows

    g = torch.Generator(device=CUDA).manual_seed(rows)
    for k in (4096, 4000) if epilogue == "none" else (4096,):
        n_w = 2 * 1792 if epilogue == "silu_mul" else 4096
        w, scale = quantize_rows(torch.randn(n_w, k, device=CUDA, generator=g) * k ** -0.5)
        x = torch.randn(rows, k, device=CUDA, generator=g).to(torch.bfloat16)
        ref = F.linear(x, dequantize_rows(w, scale, torch.bfloat16))
        res = None
        if epilogue == "residual":
            res = torch.randn(rows, n_w, device=CUDA, generator=g).to(torch.bfloat16)
            ref = ref + res
        elif epilogue == "silu_mul":
            gate, up = ref.chunk(2, dim=-1)
            ref = F.silu(gate) * up
        # None: the bucket's first candidate that fits (what an untimed plan runs)
        for cfg in (None, *CANDIDATES[bucket_of(rows)]) if k == 4096 else (None,):
            try:
                got = channel_fp8_gemm(x, w, scale, residual=res, silu_mul=epilogue == "silu_mul", config=cfg)
            except triton.runtime.errors.OutOfResources:
                assert cfg is not None
                print(f"\n{cfg.label} {epilogue}: more shared memory than this GPU has (the plan skips it)")
                continue
            assert got.shape == ref.shape and got.dtype == torch.bfloat16
            assert _rel(got, ref) < 1e-2, f"{cfg and cfg.label} k={k}: rel {_rel(got, ref):.2e}"


def test_planned_gemm_keeps_fp8_bytes_and_answers_in_place():
    """plan_channel_gemm picks one tile per row bucket on this GPU; the residual GEMM may write into
    its own residual (the fused layer accumulates in place) and still equals the reference."""
    if not _fp8_capable():
        pytest.skip("float8_e4m3fn needs compute capability >= 8.9")
    from drafter.kernels.fp8_channel import BIG, CANDIDATES, ChannelFP8Gemm, plan_channel_gemm
    from drafter.models.fp8 import dequantize_rows, quantize_rows

    g = torch.Generator(device=CUDA).manual_seed(0)
    w, scale = quantize_rows(torch.randn(4096, 4096, device=CUDA, generator=g) * 4096 ** -0.5)
    timings = {}
    two = {bucket: configs[:2] for bucket, configs in CANDIDATES.items()}  # compiled by the test above
    plan = plan_channel_gemm(w, scale, residual=True, timings=timings, candidates=two)
    assert set(plan) == {16, 32, 64, BIG} and all(min(t.values()) < float("inf") for t in timings.values())
    gemm = ChannelFP8Gemm(w, plan, plan_us=timings, scale=scale)
    for rows in (4, 48, 200):
        x = torch.randn(rows, 4096, device=CUDA, generator=g).to(torch.bfloat16)
        res = torch.randn(rows, 4096, device=CUDA, generator=g).to(torch.bfloat16)
        ref = res + F.linear(x, dequantize_rows(w, scale, torch.bfloat16))
        got = gemm(x, residual=res, out=res)
        assert got.data_ptr() == res.data_ptr() and _rel(got, ref) < 1e-2


def test_fused_fp8_engine_drafts_like_the_eager_fp8_engine(tiny_root):
    """The tiny EAGLE-3 head with --weights fp8, float32 activations: the fused Triton path with CUDA
    graphs drafts the eager torch path's tokens (the same FP8 weights; only summation order differs)."""
    if not _fp8_capable():
        pytest.skip("float8_e4m3fn needs compute capability >= 8.9")
    from tests.support.engines import build_engine
    from tests.support.scenario import Scenario

    kw = dict(k=3, max_model_len=48, max_num_seqs=4, max_num_batched_tokens=32, weights="fp8")
    ref = build_engine(tiny_root, "eagle3", **kw)
    fast = build_engine(tiny_root, "eagle3", attention_backend="triton", device=CUDA, capture_sizes=(4,),
                        token_capture_sizes=(16, 32), **kw)
    assert type(fast.head.lm_head_gemm).__name__ == "ChannelFP8Gemm"
    scenarios = [Scenario(block_sizes=e.limits.block_sizes, num_blocks=e.limits.num_blocks,
                          vocab_size=e.spec.vocab_size, hidden_width=e.spec.hidden_input_width, k=3,
                          max_model_len=48, seed=5, draft_span=e.limits.draft_span) for e in (ref, fast)]
    for plan in ([(0, 9, 0), (1, 12, 0)], [(0, 4, 1), (1, 4, 0), (2, 4, 2)], [(0, 4, 0), (2, 4, 1)]):
        expected = ref.propose(**scenarios[0].call(plan).kwargs).draft_token_ids
        call = {k: ([t.to(CUDA) for t in v] if isinstance(v, list) else v.to(CUDA))
                for k, v in scenarios[1].call(plan).kwargs.items()}
        assert torch.equal(fast.propose(**call).draft_token_ids.cpu(), expected)


def test_fp8_refused_on_a_gpu_without_fp8():
    """Below compute capability 8.9 the engine refuses --weights fp8, naming the flag."""
    if _fp8_capable():
        pytest.skip("this GPU converts float8_e4m3fn: nothing to refuse")
    from drafter.models.fp8 import FP8WeightsRefused, check_fp8_device

    with pytest.raises(FP8WeightsRefused, match="--weights fp8"):
        check_fp8_device(torch.device(CUDA))
