"""DeepSeek-V3 MTP as released: config, FP8 blocks, router, rope, absorbed MLA, and drafts equal to
a dense fp32 reference written from the equations (tests/support/dense_deepseek.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from drafter.attention.metadata import AttentionMetadata
from drafter.attention.mla import paged_mla_attention, paged_mla_attention_per_request
from drafter.models import fp8
from drafter.models.deepseek_config import DEEPSEEK_V3, MoEShape, UnsupportedConfig, parse_deepseek
from drafter.models.deepseek_loader import load_deepseek_mtp
from drafter.models.deepseek_rope import apply_interleaved_rope, cos_sin, inverse_frequencies
from drafter.models.deepseek_v3 import kv_cache_shape
from drafter.models.moe import route
from drafter.models.tiny_deepseek import TinyDeepseekSizes, deepseek_config, write_tiny_deepseek
from tests.support.dense_deepseek import DenseDeepseekMTP, DenseDeepseekReference
from tests.support.engines import build_engine, tiny_dirs
from tests.support.mtp_engine import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, EagerMTPEngine, plans
from tests.support.scenario import Scenario

RELEASED = DEEPSEEK_V3


# ------------------------------------------------------------------ config
def test_released_config_parses_to_the_mtp_layer_shape():
    cfg = parse_deepseek(RELEASED)
    (layer,) = cfg.layers
    a, m = layer.attn, layer.moe
    assert cfg.num_hidden_layers == 61 and cfg.fp8_block == (128, 128)
    assert (a.num_heads, a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.cache_width) == (128, 1536, 512, 192, 576)
    assert m is not None and (m.num_experts, m.top_k, m.num_groups, m.topk_groups) == (256, 8, 8, 4)
    assert m.correction_bias and m.grouped and m.routed_scaling_factor == 2.5 and m.num_shared_experts == 1
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert a.softmax_scale == pytest.approx(192 ** -0.5 * mscale * mscale, rel=1e-12)
    assert a.rope.cos_sin_mscale == pytest.approx(1.0)


@pytest.mark.parametrize("key,change", [
    ("rope_scaling.type", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    ("rope_scaling.attention_factor", {"rope_scaling": {**RELEASED["rope_scaling"], "attention_factor": 1.0}}),
    ("quantization_config.quant_method", {"quantization_config": {"quant_method": "gptq"}}),
    ("quantization_config.weight_block_size", {"quantization_config": {"quant_method": "fp8"}}),
    ("index_topk", {"index_topk": 2048}),
    ("hidden_act", {"hidden_act": "gelu"}),
    ("scoring_func", {"scoring_func": "sqrtsoftplus"}),
    ("n_group", {"n_group": 256, "topk_method": "greedy"}),
    ("num_nextn_predict_layers", {"num_nextn_predict_layers": 0}),
])
def test_config_refuses_what_it_does_not_compute_exactly(key, change):
    with pytest.raises(UnsupportedConfig) as err:
        parse_deepseek({**RELEASED, **change})
    assert err.value.key == key


def test_layer_index_decides_moe_or_dense():
    assert parse_deepseek({**RELEASED, "first_k_dense_replace": 62}).layers[0].moe is None
    assert parse_deepseek({**RELEASED, "moe_layer_freq": 2}).layers[0].moe is None  # 61 is odd
    assert parse_deepseek(RELEASED).layers[0].moe is not None


# ------------------------------------------------------------------ FP8 blocks
@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
def test_fp8_block_dequantisation_uses_each_blocks_scale(block):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 200, generator=g) * torch.linspace(0.1, 10, 200)  # blocks of different ranges
    q, scale = fp8.quantize(weight, block)
    assert q.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (-(-300 // block[0]), -(-200 // block[1]))
    deq = fp8.dequantize(q, scale, block)
    for i, j in [(0, 0), (block[0], 1), (299, 199), (block[0] - 1, block[1]), (2 * block[0] + 3, 150)]:
        assert deq[i, j] == q[i, j].float() * scale[i // block[0], j // block[1]]
    # e4m3 keeps 3 mantissa bits (half an ulp: 1/16 relative) down to its subnormals (steps of 2^-9 x scale)
    step = fp8.expand_scales(scale, (300, 200), block) * 2.0 ** -9
    assert ((deq - weight).abs() <= weight.abs() / 16 + step / 2 + 1e-7).all()
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fp8.dequantize(q, scale.T.contiguous(), block)


def test_fp8_linear_dequantises_in_the_gemm_and_survives_dtype_casts():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 80, generator=g)
    layer = fp8.FP8Linear(80, 96, (32, 32))
    layer.weight, layer.weight_scale_inv = fp8.quantize(weight, (32, 32))
    x = torch.randn(5, 80, generator=g)
    expected = x @ fp8.dequantize(layer.weight, layer.weight_scale_inv, (32, 32)).T
    assert torch.equal(layer(x), expected)
    w8a8 = fp8.block_fp8_linear(x, layer.weight, layer.weight_scale_inv, (32, 32), act_quant=True)
    x_deq = torch.cat([(c / (c.abs().amax(-1, keepdim=True) / 448)).to(torch.float8_e4m3fn).float()
                       * (c.abs().amax(-1, keepdim=True) / 448) for c in x.split(32, dim=1)], dim=1)
    assert torch.allclose(w8a8, x_deq @ fp8.dequantize(layer.weight, layer.weight_scale_inv, (32, 32)).T, atol=1e-5)
    assert not torch.equal(w8a8, expected)
    scale_before = layer.weight_scale_inv.clone()
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.float8_e4m3fn and torch.equal(layer.weight_scale_inv, scale_before)


# ------------------------------------------------------------------ router
def _moe_shape(**kw) -> MoEShape:
    base = dict(hidden_size=4, num_experts=8, top_k=2, intermediate_size=4, num_shared_experts=1, num_groups=4,
                topk_groups=2, normalize_topk=True, routed_scaling_factor=2.5, scoring_func="sigmoid",
                correction_bias=True)
    return MoEShape(**{**base, **kw})


def _logits_of(scores) -> torch.Tensor:
    s = torch.tensor([scores], dtype=torch.float64)
    return torch.log(s / (1 - s)).float()  # sigmoid(logit) = score


def test_router_picks_by_biased_group_sums_and_weighs_by_raw_scores():
    # groups of two: {0,1} {2,3} {4,5} {6,7}
    scores = [0.90, 0.10, 0.50, 0.50, 0.60, 0.55, 0.20, 0.85]
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.5])
    # biased group sums: 1.00, 1.00, 1.15, 0.55 -> groups {2,3} and {4,5} (expert 0 is excluded although
    # its own score is the highest: group 0 ties group 1 and loses to group 2)
    weights, ids = route(_logits_of(scores), bias, _moe_shape())
    assert ids[0].tolist() == [4, 5]
    assert torch.allclose(weights[0], torch.tensor([0.60, 0.55]) / 1.15)
    # without the bias: group maxima 0.90, 0.50, 0.60, 0.85 -> groups 0 and 3, experts 0 and 7
    weights, ids = route(_logits_of(scores), None, _moe_shape(correction_bias=False))
    assert ids[0].tolist() == [0, 7] and torch.allclose(weights[0], torch.tensor([0.90, 0.85]) / 1.75)


def test_router_bias_changes_selection_but_not_weights():
    scores = [0.30, 0.31, 0.32, 0.33, 0.34, 0.35, 0.36, 0.37]
    bias = torch.tensor([0.5, 0.5, 0, 0, 0, 0, 0, 0])
    weights, ids = route(_logits_of(scores), bias, _moe_shape(normalize_topk=False))
    assert sorted(ids[0].tolist()) == [0, 1]
    assert torch.allclose(weights[0].sort().values, torch.tensor([0.30, 0.31]))


def test_router_matches_the_dense_references_per_token_rule(tmp_path):
    write_tiny_deepseek(tmp_path, sizes=TinyDeepseekSizes(n_routed_experts=16, n_group=4, topk_group=2,
                                                          num_experts_per_tok=3))
    dense = DenseDeepseekMTP(tmp_path / "head")
    w = dense.layers[0]
    shape = parse_deepseek(dense.cfg).layers[0].moe
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(2))
    weights, ids = route(x @ w["mlp.gate.weight"].T, w["mlp.gate.e_score_correction_bias"], shape)
    for t in range(200):
        chosen, expected = dense.experts_of(w, x[t])
        assert ids[t].tolist() == chosen
        assert torch.allclose(weights[t], torch.tensor(expected, dtype=torch.float32), atol=1e-6)


# ------------------------------------------------------------------ rope
def test_yarn_frequencies_blend_between_the_correction_dimensions():
    rope = parse_deepseek(RELEASED).layers[0].attn.rope
    inv = inverse_frequencies(rope, 64)
    plain = 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    # beta_fast 32 -> dim 10.2 (floor 10), beta_slow 1 -> dim 22.9 (ceil 23) at 4096 positions
    assert torch.equal(inv[:10], plain[:10])  # fast-rotating pairs keep their frequency
    assert torch.allclose(inv[23:], plain[23:] / 40)  # slow ones are interpolated
    assert ((inv[11:23] < plain[11:23]) & (inv[11:23] > plain[11:23] / 40)).all()


def test_interleaved_rope_rotates_adjacent_pairs():
    rope = parse_deepseek(RELEASED).layers[0].attn.rope
    positions = torch.tensor([0, 1, 4095, 70000])
    x = torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(3))
    cos, sin = cos_sin(inverse_frequencies(rope, 64), rope, positions)
    out = apply_interleaved_rope(x, cos, sin)
    angles = (positions[:, None].float() * inverse_frequencies(rope, 64)[None, :]).double()  # float32, as vLLM
    pairs = torch.view_as_complex(x.double().reshape(4, 3, 32, 2)) * torch.polar(torch.ones_like(angles), angles)[:, None]
    assert torch.allclose(out.double(), torch.view_as_real(pairs).flatten(-2), atol=1e-5)
    assert torch.equal(out[0], x[0])


# ------------------------------------------------------------------ MLA
def _meta(starts, seq_lens, table, slots) -> AttentionMetadata:
    return AttentionMetadata(query_start_loc=torch.tensor(starts, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             block_table=torch.tensor(table, dtype=torch.int32), slot_mapping=torch.tensor(slots),
                             block_size=BLOCK_SIZE)


@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_absorbed_paged_mla_matches_naive_attention(tmp_path, q_lora_rank):
    write_tiny_deepseek(tmp_path, sizes=TinyDeepseekSizes(q_lora_rank=q_lora_rank, fp8_block=(16, 16)))
    head = load_deepseek_mtp(tmp_path / "head", dtype=torch.float32)
    dense = DenseDeepseekMTP(tmp_path / "head")
    attn, w = head.layers[0].self_attn, dense.layers[0]
    g = torch.Generator().manual_seed(4)
    # request 0: 20 tokens over blocks [5, 2]; request 1: 7 tokens in block 9, of which the last 3 are queries
    lengths, blocks = (20, 7), ([5, 2], [9, 0])
    cache = torch.zeros(kv_cache_shape(head.config.layers[0], 12, BLOCK_SIZE))
    hs = [torch.randn(n, 64, generator=g) for n in lengths]
    slots = [[blocks[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)] for r, n in enumerate(lengths)]
    with torch.no_grad():
        # the first 4 tokens of request 1 were written by an earlier call
        attn(hs[1][:4], torch.arange(4), cache, _meta([0, 4], [4], [blocks[1]], slots[1][:4]))
        x = torch.cat((hs[0], hs[1][4:]))
        positions = torch.cat((torch.arange(20), torch.arange(4, 7)))
        out = attn(x, positions, cache, _meta([0, 20, 23], [20, 7], blocks, slots[0] + slots[1][4:]))
    for r, n in enumerate(lengths):
        rows = range(20) if r == 0 else range(20, 23)
        for j, row in enumerate(rows):
            p = j if r == 0 else 4 + j
            mask = torch.arange(n) <= p
            ref = dense.attention(w, hs[r][: p + 1], torch.arange(p + 1), torch.ones(p + 1), mask[: p + 1])
            assert torch.allclose(out[row], ref[0], atol=1e-5, rtol=1e-4), (r, p)


def test_shape_only_paged_attention_matches_the_per_request_loop():
    g = torch.Generator().manual_seed(8)
    cache = torch.randn(12, BLOCK_SIZE, 40, generator=g)
    table = torch.randint(0, 12, (4, 3), generator=g, dtype=torch.int32)
    # requests of 3, 0 (padded), 1 and 5 query tokens; two padding token rows past the batch
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32),
                             seq_lens=torch.tensor([20, 0, 1, 41], dtype=torch.int32), block_table=table,
                             slot_mapping=torch.full((11,), -1), block_size=BLOCK_SIZE)
    q = torch.randn(11, 4, 40, generator=g)
    shaped = paged_mla_attention(q, cache, meta, 0.3, 32)
    assert torch.allclose(shaped, paged_mla_attention_per_request(q, cache, meta, 0.3, 32), atol=1e-6)
    assert shaped[9:].abs().max() == 0 and shaped[3].abs().max() > 0


# ------------------------------------------------------------------ whole head, chains of k steps
VARIANTS = {
    # name: (sizes, k values)
    "released-layout": (TinyDeepseekSizes(), (1, 3)),
    "two-layers-fp8-16x32": (TinyDeepseekSizes(num_mtp_layers=2, fp8_block=(16, 32)), (3,)),
    "unquantised-dense-mlp-no-qlora": (TinyDeepseekSizes(fp8_block=None, q_lora_rank=None, first_k_dense_replace=9,
                                                         rope_scaling=None), (2,)),
}


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_deepseek")
    for name, (sizes, _) in VARIANTS.items():
        write_tiny_deepseek(root / name, seed=5, sizes=sizes)
    return root


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("variant,k", [(v, k) for v, (_, ks) in VARIANTS.items() for k in ks])
def test_drafts_match_the_dense_reference_call_for_call(deepseek_dirs, variant, k, padded):
    out = deepseek_dirs / variant
    head = load_deepseek_mtp(out / "head", out / "target", dtype=torch.float32)
    engine = EagerMTPEngine(head, k)
    dense = DenseDeepseekReference(out / "head", out / "target", k, MAX_MODEL_LEN)
    scn = Scenario(block_sizes=(BLOCK_SIZE,), num_blocks=(NUM_BLOCKS,), vocab_size=512, hidden_width=64, k=k,
                   max_model_len=MAX_MODEL_LEN, seed=6)
    worst, crossed = 0.0, False
    for plan in plans(k):
        call = scn.call(plan, padded=padded)
        ids, logits = engine.propose(call.kwargs, padded)
        dense.last_logits = []
        assert torch.equal(ids, dense.propose(call, padded=padded)), f"plan {plan}"
        for r, ref in enumerate(dense.last_logits):
            worst = max(worst, float((logits[r] - ref).abs().max()))
        crossed |= any(int(p[-1]) + k > MAX_MODEL_LEN for p, *_ in call.rows)
    assert crossed or k == 1
    assert worst < 1e-3, worst


def test_tree_drafts_match_the_dense_reference(deepseek_dirs):
    tree = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0))
    out = deepseek_dirs / "released-layout"  # one MTP layer: every tree level reads the context's cache
    engine = EagerMTPEngine(load_deepseek_mtp(out / "head", out / "target", dtype=torch.float32), 3, tree)
    dense = DenseDeepseekReference(out / "head", out / "target", 3, MAX_MODEL_LEN)
    scn = Scenario(block_sizes=(BLOCK_SIZE,), num_blocks=(NUM_BLOCKS,), vocab_size=512, hidden_width=64, k=3,
                   max_model_len=MAX_MODEL_LEN, seed=10, draft_span=len(tree))
    for plan in ([(0, 9, 0), (1, 30, 0)], [(0, 4, 1), (1, 4, 0)], [(1, 4, 3), (0, 4, 2)]):
        call = scn.call(plan)
        ids, _ = engine.propose(call.kwargs, True)
        assert ids.shape == (len(plan), len(tree))
        assert torch.equal(ids, dense.propose_tree(call, tree))


# ------------------------------------------------------------------ checkpoint layout and loading
def test_tiny_checkpoint_has_the_released_names_and_keys(tmp_path):
    write_tiny_deepseek(tmp_path)
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    for key in ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
                "scoring_func", "topk_method", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim"):
        assert key in cfg
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["quantization_config"]["weight_block_size"] == [128, 128]
    names = set(json.loads((tmp_path / "head" / "model.safetensors.index.json").read_text())["weight_map"])
    p = "model.layers.4."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "embed_tokens.weight", "self_attn.q_a_proj.weight_scale_inv",
                 "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_b_proj.weight", "mlp.gate.weight",
                 "mlp.gate.e_score_correction_bias", "mlp.experts.7.down_proj.weight_scale_inv",
                 "mlp.shared_experts.up_proj.weight"):
        assert p + name in names
    assert p + "eh_proj.weight_scale_inv" not in names and p + "mlp.gate.weight_scale_inv" not in names


def test_loader_refuses_incomplete_checkpoints_and_float16(tmp_path):
    write_tiny_deepseek(tmp_path)
    with pytest.raises(ValueError, match="float16"):
        load_deepseek_mtp(tmp_path / "head", dtype=torch.float16)
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "head" / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 2}))
    with pytest.raises(ValueError, match="lacks"):
        load_deepseek_mtp(tmp_path / "head", dtype=torch.float32)


def test_dequantised_load_gives_the_same_logits(tmp_path):
    write_tiny_deepseek(tmp_path, sizes=TinyDeepseekSizes(fp8_block=(16, 32)))
    kept = load_deepseek_mtp(tmp_path / "head", dtype=torch.float32)
    plain = load_deepseek_mtp(tmp_path / "head", dtype=torch.float32, keep_fp8=False)
    assert not any(isinstance(m, fp8.FP8Linear) for m in plain.modules())
    meta = _meta([0, 6], [6], [[1, 0]], list(range(16, 22)))
    ids, pos, hid = torch.randint(0, 512, (6,)), torch.arange(6), torch.randn(6, 64)
    with torch.no_grad():
        outs = [h.compute_logits(h(ids, pos, hid, [torch.zeros(4, BLOCK_SIZE, 40)], [meta])[0]) for h in (kept, plain)]
    assert torch.equal(outs[0], outs[1])


def test_config_writer_round_trips_through_the_parser():
    s = TinyDeepseekSizes()
    cfg = parse_deepseek(deepseek_config(s))
    assert cfg.layers[0].moe is not None and cfg.fp8_block == (128, 128)
    assert replace(s, num_mtp_layers=2).num_mtp_layers == 2


# ------------------------------------------------------------------ the models package's entry points
def test_make_tiny_variant_and_load_head_give_the_mtp_head(tmp_path):
    from drafter.models.loader import load_head
    from drafter.models.spec import parse_head, read_config
    from drafter.models.tiny import head_sizes, write_tiny

    assert write_tiny("deepseek_mtp", tmp_path, sizes=head_sizes("deepseek_mtp")) == "deepseek_mtp"
    head = load_head(tmp_path / "head", "deepseek_mtp", tmp_path / "target")
    spec = parse_head(read_config(tmp_path / "head"), "deepseek_mtp")
    assert head.spec == spec and spec.method == "deepseek_mtp" and spec.num_kv_groups == 1
    assert spec.layer_shapes[0].kv_cache_shape(8, 16) == (8, 16, 40) and spec.hidden_input_width == 64
    with pytest.raises(ValueError, match="do not apply"):
        write_tiny("deepseek_mtp", tmp_path / "other", sizes=head_sizes("deepseek_mtp", rope="yarn"))


def test_refusals_name_the_file_key_and_value(tmp_path):
    from drafter.models.loader import load_head
    from drafter.models.spec import HeadConfigError

    write_tiny_deepseek(tmp_path)
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    (tmp_path / "head" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadConfigError) as err:
        load_head(tmp_path / "head", "deepseek_mtp")
    assert err.value.key == "rope_scaling.type" and err.value.value == "linear"
    assert str(tmp_path / "head" / "config.json") in str(err.value)


# ------------------------------------------------------------------ the engine
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_engine_drafts_match_the_dense_reference(tiny_root, padded):
    engine = build_engine(tiny_root, "deepseek_mtp", k=3, max_model_len=MAX_MODEL_LEN, padded_drafter_batch=padded)
    out = tiny_dirs(tiny_root, "deepseek_mtp")[1]
    dense = DenseDeepseekReference(out / "head", out / "target", 3, MAX_MODEL_LEN)
    scn = Scenario(block_sizes=engine.limits.block_sizes, num_blocks=engine.limits.num_blocks, vocab_size=512,
                   hidden_width=64, k=3, max_model_len=MAX_MODEL_LEN, seed=11, draft_span=engine.limits.draft_span)
    for plan in plans(3):
        call = scn.call(plan, padded=padded)
        got = engine.propose(**call.kwargs, return_logits=True)
        dense.last_logits = []
        assert torch.equal(got.draft_token_ids, dense.propose(call, padded=padded)), f"plan {plan}"
        for r, ref in enumerate(dense.last_logits):
            assert torch.allclose(got.draft_logits[r], ref, atol=1e-3)
    before = engine.kv.layers[0].clone()
    block = int(call.kwargs["block_tables"][0][0, 0])
    engine.kv.zero_blocks(0, torch.tensor([block]))
    after = engine.kv.layers[0]
    assert after.shape == (64, 16, 40) and after[block].abs().max() == 0 and before[block].abs().max() > 0
    assert torch.equal(after[block + 1:], before[block + 1:])
