"""The DeepSeek-V3 MTP head sharded over gloo ranks (heads, experts, vocabulary split) drafts what the
single-process head drafts."""

from __future__ import annotations

import pytest
import torch

from drafter.models.deepseek_loader import load_deepseek_mtp
from drafter.models.sharding import Shard
from drafter.models.tiny_deepseek import TinyDeepseekSizes, write_tiny_deepseek
from tests.support.mtp_engine import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, EagerMTPEngine, plans
from tests.support.ranks import run_ranks
from tests.support.scenario import Scenario

K = 3
# 8-row x 16-column FP8 blocks: every rank's cut (24-row q heads, 32-row kv heads, 16-column o_proj
# heads) falls on a block edge at 2 and 4 ranks; 8 experts, 512 vocabulary rows split evenly
SIZES = TinyDeepseekSizes(fp8_block=(8, 16), num_mtp_layers=2)


def drafts_of(rank: int, world: int, root: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(drafts, logits) of every call of the plan, on one rank of `world` (world 1: unsharded)."""
    torch.manual_seed(0)
    head = load_deepseek_mtp(f"{root}/head", f"{root}/target", dtype=torch.float32, shard=Shard(rank, world))
    engine = EagerMTPEngine(head, K)
    scn = Scenario(block_sizes=(BLOCK_SIZE,), num_blocks=(NUM_BLOCKS,), vocab_size=SIZES.vocab_size,
                   hidden_width=SIZES.hidden_size, k=K, max_model_len=MAX_MODEL_LEN, seed=7)
    return [engine.propose(scn.call(plan).kwargs, True) for plan in plans(K)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_deepseek_tp")
    write_tiny_deepseek(root, seed=9, sizes=SIZES)
    return str(root)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_ranks_draft_what_one_process_drafts(tiny, world):
    single = drafts_of(0, 1, tiny)
    ranks = run_ranks(drafts_of, world, tiny)
    for rank_out in ranks:
        for (ids, logits), (ref_ids, ref_logits) in zip(rank_out, single):
            assert torch.equal(ids, ref_ids)
            assert torch.allclose(logits, ref_logits, atol=1e-4)


def test_a_cut_off_a_block_edge_is_refused(tmp_path):
    write_tiny_deepseek(tmp_path, sizes=TinyDeepseekSizes(fp8_block=(16, 16)))  # 24-row q heads, 16-row blocks
    with pytest.raises(ValueError, match="block edge"):
        load_deepseek_mtp(tmp_path / "head", dtype=torch.float32, shard=Shard(1, 4))
