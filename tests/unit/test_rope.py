"""Every rope type through every backend: drafter.models.rope's torch rotation (the reference
path), the Triton rotary + KV write kernel, and whole fused heads against reference heads.

Without a GPU the kernels run under the Triton interpreter (tests/conftest.py).  That the numbers
are vLLM 0.32's is checked against vLLM's own tables in tests/vllm_parity (test_rope_tables_equal_vllm).
"""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")

from drafter.attention.metadata import AttentionMetadata  # noqa: E402
from drafter.attention.reference import ReferenceBackend  # noqa: E402
from drafter.attention.triton_backend import TritonBackend  # noqa: E402
from drafter.engine.config import EngineConfig, KVGroupSpec  # noqa: E402
from drafter.engine.engine import DraftEngine  # noqa: E402
from drafter.models.rope import Rope, apply_rope  # noqa: E402
from drafter.models.tiny import head_sizes, write_tiny  # noqa: E402
from tests.support.scenario import Scenario  # noqa: E402
from tests.support.triton_bounds import allowing  # noqa: E402
from tests.support.triton_bounds import bounds_checked  # noqa: E402,F401 - an autouse fixture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEAD_DIM = 32

# one rope of each type vLLM 0.32 applies to Llama draft layers, scaled so that it bites below position 64
ROPES = {
    "default": Rope(HEAD_DIM, HEAD_DIM, 10000.0),
    "qwen3-theta": Rope(HEAD_DIM, HEAD_DIM, 1e6),
    "linear": Rope(HEAD_DIM, HEAD_DIM, 10000.0, "linear", factor=4.0),
    "dynamic": Rope(HEAD_DIM, HEAD_DIM, 10000.0, "dynamic", factor=2.0, dynamic_base_ratio=3.0),
    "ntk": Rope(HEAD_DIM, HEAD_DIM, 10000.0, "ntk", factor=4.0),
    "ntk-mixed": Rope(HEAD_DIM, HEAD_DIM, 10000.0, "ntk", factor=4.0, mixed_b=0.75),
    "llama3": Rope(HEAD_DIM, HEAD_DIM, 500000.0, "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32),
    "yarn": Rope(HEAD_DIM, HEAD_DIM, 10000.0, "yarn", factor=4.0, original_max_position_embeddings=32,
                 magnitude=0.1 * math.log(4.0) + 1.0),
    "longrope": Rope(HEAD_DIM, HEAD_DIM, 10000.0, "longrope", original_max_position_embeddings=16, magnitude=1.2,
                     rescale_factors=tuple(1.0 + 0.25 * i for i in range(HEAD_DIM // 2))),
    "partial-yarn": Rope(HEAD_DIM, HEAD_DIM // 2, 10000.0, "yarn", factor=4.0, original_max_position_embeddings=32,
                         magnitude=1.1),
    "partial-quarter": Rope(HEAD_DIM, HEAD_DIM // 4, 1000.0, "linear", factor=2.0),
}


def _case(n=7, heads=4, kv_heads=2, block_size=8, num_blocks=12, seed=0):
    """One request of n tokens at positions 40.. (past every rope's original context), a fresh cache."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * HEAD_DIM, generator=g)
    positions = torch.arange(40, 40 + n)
    table = torch.randperm(num_blocks, generator=g)[:8].int()[None]
    slots = (table[0, positions // block_size].long() * block_size + positions % block_size)
    meta = AttentionMetadata(torch.tensor([0, n], dtype=torch.int32), torch.tensor([40 + n], dtype=torch.int32),
                             table, slots, block_size)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, HEAD_DIM)
    return qkv, positions, meta, cache, heads, kv_heads


def _meta_to(meta: AttentionMetadata, device) -> AttentionMetadata:
    return AttentionMetadata(meta.query_start_loc.to(device), meta.seq_lens.to(device), meta.block_table.to(device),
                             meta.slot_mapping.to(device), meta.block_size)


@pytest.mark.parametrize("name,dtype", [(n, torch.float32) for n in sorted(ROPES)]
                         + [("yarn", torch.bfloat16), ("partial-quarter", torch.bfloat16)])
def test_rope_kernel_matches_reference_rotation(name, dtype):
    """forward_rope (rotary + KV write in one kernel) == apply_rope, then the reference backend:
    the same attention output and the same rotated keys in the cache, for every rope type.  bf16
    (cos / sin rounded to bf16 on both sides, as vLLM's table): the cache within two bf16 steps (cos
    and sin are rounded from slightly different f32 values); the interpreter's bf16 attention is
    not compared here."""
    rope = ROPES[name]
    qkv, positions, meta, cache, heads, kv_heads = _case()
    qkv, cache = qkv.to(dtype), cache.to(dtype)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    n = qkv.shape[0]
    q, k, v = qkv.split([heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], dim=-1)
    ref_cache = cache.clone()
    expected = ReferenceBackend().forward(apply_rope(q.reshape(n, heads, HEAD_DIM), positions, rope),
                                          apply_rope(k.reshape(n, kv_heads, HEAD_DIM), positions, rope),
                                          v.reshape(n, kv_heads, HEAD_DIM), ref_cache, meta)
    dev_cache = cache.to(DEVICE)
    out = TritonBackend().forward_rope(qkv.to(DEVICE), positions.to(DEVICE), rope.tables(torch.device(DEVICE)),
                                       heads, dev_cache, _meta_to(meta, DEVICE))
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), expected, **tol)
    torch.testing.assert_close(dev_cache.cpu().float(), ref_cache.float(), **tol)


def test_rope_types_differ_from_plain_rope():
    """The cases above are not the plain rope in disguise (a kernel ignoring the tables would pass)."""
    positions = torch.arange(40, 60)
    plain = torch.cat(ROPES["default"].cos_sin(positions, torch.float32), dim=-1)
    for name, rope in ROPES.items():
        if name != "default" and rope.rotary_dim == HEAD_DIM:
            ours = torch.cat(rope.cos_sin(positions, torch.float32), dim=-1)
            assert (ours - plain).abs().max() > 1e-2, name


def test_partial_rotary_leaves_the_tail_alone():
    x = torch.randn(5, 3, HEAD_DIM)
    out = apply_rope(x, torch.arange(5) + 9, ROPES["partial-quarter"])
    assert torch.equal(out[..., HEAD_DIM // 4:], x[..., HEAD_DIM // 4:])
    assert not torch.equal(out[..., :HEAD_DIM // 4], x[..., :HEAD_DIM // 4])


def test_linear_scaling_divides_the_position():
    """linear(factor f) at position p rotates as plain rope at p / f (vLLM builds its table so)."""
    rope, plain = ROPES["linear"], ROPES["default"]
    for a, b in zip(rope.cos_sin(torch.arange(0, 64, 4), torch.float32),
                    plain.cos_sin(torch.arange(0, 16), torch.float32)):
        assert torch.equal(a, b)


def test_llama3_keeps_short_wavelengths_and_divides_long_ones():
    rope = ROPES["llama3"]
    plain = Rope(HEAD_DIM, HEAD_DIM, rope.theta).inv_freq()
    inv = rope.inv_freq()
    wavelen = 2 * math.pi / plain
    short, long = wavelen < 32 / 4.0, wavelen > 32 / 1.0
    assert short.any() and long.any()
    assert torch.equal(inv[short], plain[short])
    assert torch.equal(inv[long], plain[long] / 8.0)


def test_cos_sin_carry_the_activation_dtype():
    """vLLM keeps its cos / sin table in the model dtype: bf16 values, for every backend alike."""
    cos, sin = ROPES["yarn"].cos_sin(torch.arange(100), torch.bfloat16)
    assert torch.equal(cos, cos.bfloat16().float()) and torch.equal(sin, sin.bfloat16().float())
    assert cos.abs().max() > 1.0  # yarn's attention factor scales them


# ------------------------------------------------------------------------- whole heads, fused vs reference

HEADS = {  # name: (make-tiny variant, head_sizes flags)
    "eagle3-llama3-bias": ("eagle3", dict(rope="llama3", rope_layout="params", attention_bias=True, mlp_bias=True)),
    "eagle-yarn-partial": ("eagle", dict(rope="yarn", partial_rotary_factor=0.5, mlp_bias=True)),
    "eagle3-plain-linear": ("eagle3", dict(rope="linear", eagle3_layout="plain", head_dim=64, attention_bias=True)),
}
# the weight GEMMs of the fused path: the skinny kernel on a GPU; on CPU (interpreted, most of the time
# these took) only for the head with biases on every layer, torch's GEMMs for the other two, whose
# subject is the rotary and KV-write kernel
SKINNY = {name: "on" if DEVICE == "cuda" or name == "eagle3-llama3-bias" else "off" for name in HEADS}
MAX_MODEL_LEN = 64
# a prefill to position ~40, decode steps with rejections
PLANS = [[(0, 30, 0), (1, 38, 0)], [(0, 4, 1), (1, 4, 0)], [(0, 4, 2), (1, 4, 3)]]


def _engine(root, name, backend):
    variant, flags = HEADS[name]
    out = root / f"rope-{name}"
    if not (out / "head" / "config.json").exists():
        write_tiny(variant, out, sizes=head_sizes(variant, **flags))
    cfg = EngineConfig(method=variant, num_speculative_tokens=3, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                       max_num_batched_tokens=80, kv_groups=(KVGroupSpec(16, 32),), attention_backend=backend,
                       device="cpu" if backend == "reference" else DEVICE, skinny_gemm=SKINNY[name])
    return DraftEngine.from_dirs(out / "head", out / "target", cfg)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_fused_head_matches_reference_head(tiny_root, name):
    """Heads with scaled ropes, biases, partial rotary, head_dim 64: the fused path (q/k/v GEMM,
    rotary + KV write kernel, norms in kernels) drafts what the reference path drafts."""
    ref, fast = _engine(tiny_root, name, "reference"), _engine(tiny_root, name, "triton")
    assert fast.backend.name == "triton" and getattr(fast.head, "fused", False)
    scenarios = [Scenario(block_sizes=e.limits.block_sizes, num_blocks=e.limits.num_blocks,
                          vocab_size=e.spec.vocab_size, hidden_width=e.spec.hidden_input_width, k=3,
                          max_model_len=MAX_MODEL_LEN, seed=5, draft_span=e.limits.draft_span) for e in (ref, fast)]
    for plan in PLANS:
        c_ref, c_fast = (s.call(plan) for s in scenarios)
        expected = ref.propose(**c_ref.kwargs, return_logits=True)
        kwargs = {k: ([t.to(DEVICE) for t in v] if isinstance(v, list) else v.to(DEVICE))
                  for k, v in c_fast.kwargs.items()}
        with allowing([t for v in kwargs.values() for t in (v if isinstance(v, list) else [v])]):
            got = fast.propose(**kwargs, return_logits=True)
        assert torch.equal(got.draft_token_ids.cpu(), expected.draft_token_ids), f"{name} plan {plan}"
        torch.testing.assert_close(got.draft_logits.cpu(), expected.draft_logits, atol=1e-3, rtol=1e-3)
