"""DraftEngine at tensor-parallel 2 and 4 (gloo ranks in fresh processes): EAGLE-3, Llama-style MTP,
DeepSeek-V3 MTP and EAGLE-1 (biases on q/k/v, o and the MLP; a full-attention and a sliding-window
layer in two KV groups) heads sharded by head, MLP column and vocabulary draft on every rank what the
single-process engine drafts (greedy and sampled), with the same logits; sizes that do not split are
refused naming their config key."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.engine.engine import DraftEngine
from drafter.models.llama_shard import shard_spec
from drafter.models.loader import load_head
from drafter.models.sharding import Shard
from drafter.models.spec import parse_head, read_config
from drafter.models.tiny import TinySizes, write_tiny
from drafter.models.tiny_deepseek import TinyDeepseekSizes, write_tiny_deepseek
from tests.support.mtp_engine import plans
from tests.support.ranks import run_ranks
from tests.support.scenario import Scenario

K = 3
MAX_MODEL_LEN = 96
BLOCK_SIZE = 16
NUM_BLOCKS = 64
METHODS = ("eagle3", "mtp", "deepseek_mtp", "eagle")
EAGLE_SIZES = replace(TinySizes(), attention_bias=True, mlp_bias=True,
                      head_layer_types=("full_attention", "sliding_attention"))
BLOCK_SIZES = {"eagle": (BLOCK_SIZE, 8)}  # two KV groups, block sizes 16 and 8
# 8 x 16 FP8 blocks: the tiny DeepSeek head's heads, experts and vocabulary cut on block edges at 2 and 4 ranks
DEEPSEEK_SIZES = TinyDeepseekSizes(fp8_block=(8, 16))


def write_heads(root: Path) -> None:
    for method in METHODS:
        if method == "deepseek_mtp":
            write_tiny_deepseek(root / method, seed=5, sizes=DEEPSEEK_SIZES)
        elif method == "eagle":
            write_tiny(method, root / method, seed=4, sizes=EAGLE_SIZES)
        else:
            write_tiny(method, root / method, seed=3)


def engine_config(method: str, device: str = "cpu") -> EngineConfig:
    return EngineConfig(method=method, num_speculative_tokens=K, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                        max_num_batched_tokens=256, seed=11, device=device, skinny_gemm="off",
                        kv_groups=tuple(KVGroupSpec(bs, NUM_BLOCKS) for bs in BLOCK_SIZES.get(method, (BLOCK_SIZE,))))


def drafts_of(rank: int, world: int, root: str, device: str = "cpu"
              ) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per method: (drafts, logits) of every call of the plan on one rank (world 1: unsharded);
    tests/gpu/test_tp_gpu.py runs it on NCCL ranks, one GPU each."""
    out = {}
    for method in METHODS:
        d = Path(root) / method
        engine = DraftEngine.from_dirs(d / "head", d / "target", engine_config(method, device),
                                       shard=Shard(rank, world))
        spec = engine.spec
        sizes = BLOCK_SIZES.get(method, (BLOCK_SIZE,))
        scn = Scenario(block_sizes=sizes, num_blocks=(NUM_BLOCKS,) * len(sizes), vocab_size=spec.vocab_size,
                       hidden_width=spec.hidden_input_width, k=K, max_model_len=MAX_MODEL_LEN, seed=7)
        calls = []
        for i, plan in enumerate(plans(K)):
            temps = [0.8] * len(plan) if i == 2 else None  # one sampled call: the same generator on every rank
            out_i = engine.propose(**scn.call(plan, temperatures=temps).kwargs, return_logits=True)
            calls.append((out_i.draft_token_ids, out_i.draft_logits))
        out[method] = calls
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_engine")
    write_heads(root)
    return str(root)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_engines_draft_what_one_process_drafts(tiny, world):
    single = drafts_of(0, 1, tiny)
    for rank_out in run_ranks(drafts_of, world, tiny):
        for method in METHODS:
            for (ids, logits), (ref_ids, ref_logits) in zip(rank_out[method], single[method]):
                assert torch.equal(ids, ref_ids), method
                assert torch.allclose(logits, ref_logits, atol=1e-4), method


def test_a_rank_holds_its_share_of_heads_columns_and_vocabulary(tiny):
    d = Path(tiny) / "eagle3"
    whole = load_head(d / "head", "eagle3", d / "target")
    part = load_head(d / "head", "eagle3", d / "target", shard=Shard(1, 4))
    s, p = whole.spec.layer_shapes[0], part.spec.layer_shapes[0]
    assert (p.num_heads, p.intermediate_size) == (s.num_heads // 4, s.intermediate_size // 4)
    assert p.num_kv_heads == 1  # 2 KV heads over 4 ranks: each rank keeps the one its query head reads
    q = part.layers[0].self_attn.q_proj.weight
    assert torch.equal(q, whole.layers[0].self_attn.q_proj.weight[s.head_dim: 2 * s.head_dim])
    k = part.layers[0].self_attn.k_proj.weight
    assert torch.equal(k, whole.layers[0].self_attn.k_proj.weight[0: s.head_dim])  # rank 1 reads KV head 0
    rows = whole.spec.draft_vocab_size // 4
    assert torch.equal(part.lm_head.weight, whole.lm_head.weight[rows: 2 * rows])


@pytest.mark.parametrize("world, key", [(3, "num_attention_heads"), (8, "num_attention_heads")])
def test_a_size_that_does_not_split_is_refused_naming_its_key(tiny, world, key):
    spec = parse_head(read_config(Path(tiny) / "mtp" / "head"), "mtp")
    with pytest.raises(ValueError, match=key):
        shard_spec(spec, Shard(0, world))
