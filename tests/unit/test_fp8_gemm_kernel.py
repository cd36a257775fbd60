"""The grouped FP8 block GEMM kernel (under the Triton interpreter on CPU) against torch's dequantise-and-matmul."""

from __future__ import annotations

import pytest
import torch

from drafter.attention.metadata import AttentionMetadata
from drafter.kernels.fp8_gemm import BLOCK_M, dense_gemm, grouped_gemm
from drafter.models import fp8
from drafter.models.deepseek_loader import load_deepseek_mtp
from drafter.models.moe import plan_slots
from drafter.models.tiny_deepseek import TinyDeepseekSizes, write_tiny_deepseek
from tests.support.triton_bounds import checking


def _experts(num: int, n: int, k: int, block, seed: int):
    g = torch.Generator().manual_seed(seed)
    pairs = [fp8.quantize(torch.randn(n, k, generator=g), block) for _ in range(num)]
    return torch.stack([w for w, _ in pairs]), torch.stack([s for _, s in pairs])


@pytest.mark.parametrize("n,k,block", [(40, 72, (16, 32)), (130, 200, (128, 128))])
def test_grouped_slots_read_their_rows_through_their_experts_weights(n, k, block):
    weight, scale = _experts(3, n, k, block, seed=0)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    # blocks: expert 2 (rows 4, 0, 6 + padding), unused, expert 0 (rows 1, 1, 5)
    rows = torch.full((3 * BLOCK_M,), -1, dtype=torch.int32)
    rows[:3] = torch.tensor([4, 0, 6])
    rows[2 * BLOCK_M: 2 * BLOCK_M + 3] = torch.tensor([1, 1, 5])
    experts = torch.tensor([2, -1, 0], dtype=torch.int32)
    with checking():
        out = grouped_gemm(x, rows, experts, weight, scale, block)
    for slot, e in [(0, 2), (1, 2), (2, 2), (2 * BLOCK_M, 0), (2 * BLOCK_M + 1, 0), (2 * BLOCK_M + 2, 0)]:
        expected = x[int(rows[slot])] @ fp8.dequantize(weight[e], scale[e], block).T
        assert torch.allclose(out[slot], expected, atol=1e-4, rtol=1e-5), slot


def test_dense_gemm_matches_the_torch_path_for_fp8_and_plain_weights():
    weight, scale = _experts(1, 96, 80, (32, 32), seed=2)
    x = torch.randn(5, 80, generator=torch.Generator().manual_seed(3))
    with checking():
        got = dense_gemm(x, weight[0], scale[0], (32, 32))
        plain = dense_gemm(x, weight[0].float(), None, None)
    assert torch.allclose(got, fp8.block_fp8_linear(x, weight[0], scale[0], (32, 32)), atol=1e-4)
    assert torch.allclose(plain, x @ weight[0].float().T, atol=1e-4)


def test_slot_plan_gives_each_local_expert_whole_blocks_of_its_own_pairs():
    ids = torch.randint(0, 16, (23, 3), generator=torch.Generator().manual_seed(4))
    rows, pair, expert_of_block = plan_slots(ids, 4, 8, BLOCK_M)  # this rank holds experts 4 .. 11
    assert rows.shape[0] % BLOCK_M == 0 and expert_of_block.shape[0] == rows.shape[0] // BLOCK_M
    expected = sorted((t, int(e)) for t in range(23) for e in ids[t] if 4 <= e < 12)
    got = []
    for s in range(rows.shape[0]):
        if rows[s] >= 0:
            e = int(expert_of_block[s // BLOCK_M])
            assert e >= 0 and int(ids.flatten()[pair[s]]) == e + 4 and int(pair[s]) // 3 == int(rows[s])
            got.append((int(rows[s]), e + 4))
    assert sorted(got) == expected


def test_head_through_the_kernels_gives_the_torch_paths_logits(tmp_path):
    write_tiny_deepseek(tmp_path, sizes=TinyDeepseekSizes(fp8_block=(16, 32)))
    heads = [load_deepseek_mtp(tmp_path / "head", dtype=torch.float32, kernels=k) for k in (False, True)]
    assert heads[1].layers[0].mlp.stacked is not None
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 6], dtype=torch.int32),
                             seq_lens=torch.tensor([6], dtype=torch.int32), block_table=torch.tensor([[1, 0]]),
                             slot_mapping=torch.arange(16, 22), block_size=16)
    g = torch.Generator().manual_seed(5)
    ids, pos, hid = torch.randint(0, 512, (6,), generator=g), torch.arange(6), torch.randn(6, 64, generator=g)
    with torch.no_grad(), checking():
        logits = [h.compute_logits(h(ids, pos, hid, [torch.zeros(4, 16, 40)], [meta])[0]) for h in heads]
    assert torch.allclose(logits[0], logits[1], atol=1e-3)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


def test_latent_rows_land_at_their_slots_and_padding_writes_nothing():
    from drafter.kernels.latent_write import write_rows

    cache = torch.zeros(3, 4, 40)
    rows = torch.randn(5, 40, generator=torch.Generator().manual_seed(6))
    slots = torch.tensor([5, -1, 0, 11, -1])
    with checking():
        write_rows(cache, rows, slots)
    flat = cache.view(-1, 40)
    assert torch.equal(flat[[5, 0, 11]], rows[[0, 2, 3]])
    assert flat.abs().sum(-1).nonzero().flatten().tolist() == [0, 5, 11]


def test_expert_parallel_rank_sums_only_its_own_experts_through_the_kernels():
    from drafter.models.deepseek_config import parse_deepseek
    from drafter.models.moe import MoE, route
    from drafter.models.sharding import Shard
    from drafter.models.tiny_deepseek import deepseek_config

    shape = parse_deepseek(deepseek_config(TinyDeepseekSizes(fp8_block=(16, 32)))).layers[0].moe
    g = torch.Generator().manual_seed(7)
    moe = MoE(shape, (16, 32), Shard(1, 2))  # experts 4 .. 7
    for module in moe.modules():
        if isinstance(module, fp8.FP8Linear):
            module.weight, module.weight_scale_inv = fp8.quantize(torch.randn(module.weight.shape, generator=g),
                                                                  (16, 32))
    x = torch.randn(9, 64, generator=g)
    weights, ids = route(torch.randn(9, 8, generator=g), None, shape)
    expected = torch.zeros(9, 64)
    for t in range(9):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 4 <= e < 8:
                expected[t] += weights[t, j] * moe.experts[str(e)](x[t:t + 1])[0]
    moe.stack_experts()
    with checking():
        got = moe._routed_grouped(x, weights, ids)
    assert torch.allclose(got, expected, atol=1e-4)


@pytest.mark.parametrize("heads,latent,rope", [(4, 32, 8), (20, 64, 16)])
def test_mla_attention_kernel_matches_the_per_request_loop(heads, latent, rope):
    from drafter.attention.mla import paged_mla_attention_per_request
    from drafter.kernels.mla_attention import mla_attention

    g = torch.Generator().manual_seed(8)
    cache = torch.randn(12, 16, latent + rope, generator=g)
    table = torch.randint(0, 12, (4, 4), generator=g, dtype=torch.int32)
    # requests of 3, 0 (padded), 1 and 5 query tokens (the last over 50 keys: two tiles); two padding rows
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32),
                             seq_lens=torch.tensor([20, 0, 1, 50], dtype=torch.int32), block_table=table,
                             slot_mapping=torch.full((11,), -1), block_size=16)
    q = torch.randn(11, heads, latent + rope, generator=g)
    with checking():
        got = mla_attention(q, cache, meta.query_start_loc, meta.seq_lens, table, 0.2, latent)
    assert torch.allclose(got, paged_mla_attention_per_request(q, cache, meta, 0.2, latent), atol=1e-5)
    assert got[9:].abs().max() == 0
