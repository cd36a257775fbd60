"""--weights fp8 (EngineConfig.weights): per-output-channel FP8 e4m3 GEMM weights for the draft heads.

Quantisation error bounds per row, the refusals (naming the flag), the per-channel kernel under the
Triton interpreter against the dequantise-then-matmul reference, the FP8 engine's logits against the
bf16 (here: float32 checkpoint) engine's within a stated tolerance, and the fused FP8 path's drafts
equal to the eager FP8 engine's.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from drafter.engine.config import EngineConfig  # noqa: E402
from drafter.models import fp8  # noqa: E402
from tests.support.engines import build_engine  # noqa: E402
from tests.support.scenario import Scenario  # noqa: E402

K = 3
# the step-0 logits of an FP8 head against the checkpoint's: relative Frobenius error at most this
# (measured 0.064 / 0.066 on the tiny random EAGLE-1 / EAGLE-3 heads: e4m3 keeps 3 mantissa bits,
# ~2.2% rms relative error per weight, compounding over fc, the layer's GEMMs and the lm_head)
LOGITS_REL_TOL = 0.10


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


# ---------------------------------------------------------------------- quantisation
def test_quantize_rows_error_is_bounded_per_row():
    """Each row's scale is its absmax / 448; every entry is within 2^-4 of its own magnitude (3
    mantissa bits, round to nearest) or, in e4m3's subnormal range, within 2^-10 of the row scale;
    rows of very different magnitude keep their own precision; an all-zero row stays zero."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 300, generator=g) * torch.logspace(-4, 2, 64)[:, None]
    w[7] = 0.0
    w[9, :10] = torch.tensor([1e-9, -1e-7, 3e-6, 0.5, -0.25, 1.0, 2.0, -3.0, 1e-3, 0.0])
    q, scale = fp8.quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (64,)
    amax = w.abs().amax(dim=1)
    assert torch.allclose(scale[amax > 0], amax[amax > 0] / fp8.FP8_MAX)
    assert scale[7] == 1.0
    back = fp8.dequantize_rows(q, scale)
    err = (back - w).abs()
    bound = torch.maximum(w.abs() * 2 ** -4, scale[:, None] * 2 ** -10) * (1 + 1e-6)
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max()):.3e}"
    assert bool((back[7] == 0).all())
    assert torch.allclose(back.abs().amax(dim=1), amax, rtol=1e-6, atol=0), "each row's largest entry: 448 * scale"
    per_row = (err.norm(dim=1) / w.norm(dim=1).clamp_min(1e-30))[amax > 0]
    assert float(per_row.max()) < 0.05  # rms ~ 2^-4 / sqrt(3) = 3.6% at worst, ~2.2% typical


def test_dequantize_rows_refuses_a_non_fp8_payload():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.dequantize_rows(torch.zeros(2, 2), torch.ones(2))


def test_channel_linear_keeps_fp8_through_dtype_casts_and_matches_the_reference():
    lin = nn.Linear(40, 24, bias=True)
    q, scale = fp8.quantize_rows(lin.weight)
    layer = fp8.ChannelFP8Linear(lin).to(torch.bfloat16)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.bfloat16
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(layer.weight_scale, scale)
    x = torch.randn(5, 40).to(torch.bfloat16)
    want = F.linear(x, fp8.dequantize_rows(q, scale, torch.bfloat16), layer.bias)
    assert torch.equal(layer(x), want)


# ---------------------------------------------------------------------- head and refusals
@pytest.mark.parametrize("name", ["eagle", "eagle3", "mtp"])
def test_quantize_head_swaps_the_gemm_linears_and_leaves_embeddings(tiny_root, name):
    engine = build_engine(tiny_root, name, weights="fp8")
    head = engine.head
    kinds = {n.rsplit(".", 1)[-1]: type(m) for n, m in head.named_modules() if n}
    for gemm in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert kinds[gemm] is fp8.ChannelFP8Linear, gemm
    assert kinds.get("lm_head", kinds.get("head")) is fp8.ChannelFP8Linear
    assert kinds.get("fc", kinds.get("eh_proj")) is fp8.ChannelFP8Linear
    assert not any(type(m) is nn.Linear for m in head.modules()), "every GEMM weight is FP8"
    embeds = [m for m in head.modules() if isinstance(m, nn.Embedding)]
    assert embeds and all(e.weight.dtype == torch.float32 for e in embeds)
    assert fp8.quantize_head(head) is head, "idempotent: engines may share a head"


def test_config_refuses_fp8_where_unsupported():
    with pytest.raises(ValueError, match="weights must be bf16 or fp8"):
        EngineConfig(method="eagle3", weights="int8")
    for method in ("deepseek_mtp", "extract_hidden_states"):
        with pytest.raises(ValueError, match=r"--weights fp8"):
            EngineConfig(method=method, weights="fp8", num_speculative_tokens=1)
    assert EngineConfig(method="eagle3").weights == "bf16"


def test_a_block_quantised_head_is_refused_naming_the_flag():
    """An input that is already FP8 block-quantised (DeepSeek's weight_scale_inv layers) runs as shipped."""
    head = nn.Module()
    head.layer = fp8.FP8Linear(32, 16, (16, 16))
    with pytest.raises(fp8.FP8WeightsRefused, match="--weights fp8.*block-quantised"):
        fp8.quantize_head(head)


def test_a_head_fused_with_bf16_weights_is_refused():
    head = nn.Module()
    head.fc = nn.Linear(8, 8)
    head.fused = True
    with pytest.raises(fp8.FP8WeightsRefused, match="--weights fp8"):
        fp8.quantize_head(head)


# ---------------------------------------------------------------------- the kernel (interpreter on CPU)
@pytest.mark.parametrize("rows", [3, 70])
@pytest.mark.parametrize("epilogue", ["none", "residual", "silu_mul"])
def test_channel_kernel_matches_dequantise_then_matmul(rows, epilogue):
    """Every candidate tile of the row bucket (swapped MMAs included), a ragged K, float32."""
    from drafter.kernels.fp8_channel import CANDIDATES, bucket_of, channel_fp8_gemm

    g = torch.Generator().manual_seed(rows)
    w, scale = fp8.quantize_rows(torch.randn(96, 200, generator=g))
    x = torch.randn(rows, 200, generator=g)
    want = F.linear(x, fp8.dequantize_rows(w, scale))
    res = None
    if epilogue == "residual":
        res = torch.randn(rows, 96, generator=g)
        want = want + res
    elif epilogue == "silu_mul":
        gate, up = want.chunk(2, dim=-1)
        want = F.silu(gate) * up
    for cfg in CANDIDATES[bucket_of(rows)]:
        got = channel_fp8_gemm(x, w, scale, residual=res, silu_mul=epilogue == "silu_mul", config=cfg)
        assert got.shape == want.shape
        assert _rel(got, want) < 1e-6, cfg.label


def test_channel_kernel_refuses_a_bf16_weight():
    from drafter.kernels.fp8_channel import channel_fp8_gemm

    with pytest.raises(ValueError, match="float8_e4m3fn"):
        channel_fp8_gemm(torch.randn(2, 8), torch.randn(4, 8), torch.ones(4))


# ---------------------------------------------------------------------- engines
def _scenario(engine, seed=3):
    return Scenario(block_sizes=engine.limits.block_sizes, num_blocks=engine.limits.num_blocks,
                    vocab_size=engine.spec.vocab_size, hidden_width=engine.spec.hidden_input_width, k=K,
                    max_model_len=48, seed=seed, draft_span=engine.limits.draft_span)


PLANS = ([(0, 9, 0), (1, 12, 0)], [(0, K + 1, 1), (1, K + 1, 0), (2, K + 1, 2)], [(0, K + 1, 0), (2, K + 1, 1)])
SMALL = dict(k=K, max_model_len=48, max_num_seqs=4, max_num_batched_tokens=32)


def _step_logits(engine, call) -> torch.Tensor:
    """The logits of the first draft position of a propose call: [batch, head vocab]."""
    seen = []
    plain = engine.head.compute_logits

    def record(hidden, step=0):
        out = plain(hidden, step)
        seen.append(out.detach().clone())
        return out

    engine.head.compute_logits = record
    try:
        drafts = engine.propose(**call).draft_token_ids
    finally:
        del engine.head.compute_logits
    return seen[0], drafts


@pytest.mark.parametrize("name", ["eagle3", "eagle"])
def test_fp8_engine_logits_close_to_the_checkpoint_engine(tiny_root, name):
    """The same calls through the checkpoint-weights engine and the --weights fp8 engine: every
    call's first-position logits within LOGITS_REL_TOL (relative Frobenius), and most drafts agree."""
    base, quant = build_engine(tiny_root, name, **SMALL), build_engine(tiny_root, name, weights="fp8", **SMALL)
    s_base, s_quant = _scenario(base), _scenario(quant)
    agree, total = 0, 0
    for plan in PLANS:
        want, d_base = _step_logits(base, s_base.call(plan).kwargs)
        got, d_quant = _step_logits(quant, s_quant.call(plan).kwargs)
        rel = _rel(got, want)
        print(f"\n[fp8 {name}] step-0 logits rel. error {rel:.4f}")
        assert rel < LOGITS_REL_TOL
        agree += int((d_base[:, 0] == d_quant[:, 0]).sum())
        total += d_base.shape[0]
    assert agree >= total // 2, f"first drafts agree {agree}/{total}"


def test_fused_fp8_path_drafts_the_eager_fp8_engines_tokens(tiny_root):
    """The Triton path (interpreter on CPU, graphs emulated) with --weights fp8 against the torch
    reference path with --weights fp8: equal drafts (float32 activations)."""
    pytest.importorskip("triton")
    from drafter.engine.graphs import GraphRunner

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = build_engine(tiny_root, "eagle3", weights="fp8", **SMALL)
    fast = build_engine(tiny_root, "eagle3", weights="fp8", attention_backend="triton", device=device,
                        capture_sizes=(4,), token_capture_sizes=(16, 32), **SMALL)
    if device == "cpu":
        fast.graphs = GraphRunner(fast, emulate=True)
    assert type(fast.head.lm_head_gemm).__name__ == "ChannelFP8Gemm"
    s_ref, s_fast = _scenario(ref), _scenario(fast)
    for plan in PLANS[:2]:  # a prefill and a decode step: the interpreter takes ~10 s per call here
        want = ref.propose(**s_ref.call(plan).kwargs).draft_token_ids
        call = {k: ([t.to(device) for t in v] if isinstance(v, list) else v.to(device))
                for k, v in s_fast.call(plan).kwargs.items()}
        assert torch.equal(fast.propose(**call).draft_token_ids.cpu(), want)


def test_serve_flag_and_environment_reach_the_engine_config(tiny_root):
    """`drafter serve --weights fp8` (or DRAFTER_WEIGHTS=fp8) sets EngineConfig.weights; bf16 by default."""
    import argparse

    from drafter.service.config import add_arguments, from_args
    from drafter.service.server import engine_config
    from tests.support.engines import tiny_dirs

    _, out = tiny_dirs(tiny_root, "eagle3")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--method", "eagle3", "--model", str(out / "head"), "--target-model", str(out / "target"),
            "--device", "cpu"]
    assert engine_config(from_args(parser.parse_args(argv), environ={})).weights == "bf16"
    assert engine_config(from_args(parser.parse_args(argv + ["--weights", "fp8"]), environ={})).weights == "fp8"
    assert engine_config(from_args(parser.parse_args(argv), environ={"DRAFTER_WEIGHTS": "fp8"})).weights == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(argv + ["--weights", "int4"])
