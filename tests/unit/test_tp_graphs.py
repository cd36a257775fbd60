"""The graph path of a tensor-parallel head on CPU: gloo ranks (fresh processes) whose engines run the
GraphRunner's data flow emulated (capture keeps each step's function, replay calls it again, the
Triton input / output kernels under the interpreter) over the per-shard fused layers
(drafter.models.shard_fusion: fused q/k/v + rotary + KV write, SiLU epilogue, norm kernels) with the
sharded collectives inside draft what
the single-process eager engine drafts, for EAGLE-3, Llama-style MTP, DeepSeek-V3 MTP and EAGLE-1;
and the vocabulary-parallel greedy pick (each rank's top-1 gathered) equals torch.argmax over the
whole row, ties included.  tests/gpu/test_tp_gpu.py runs the same with real graphs over NCCL."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # inherited by the spawned ranks

pytest.importorskip("triton", reason="triton is not installed: the graph path's kernels cannot run")

from dataclasses import replace  # noqa: E402

from drafter.engine.engine import DraftEngine  # noqa: E402
from drafter.engine.graphs import GraphRunner  # noqa: E402
from drafter.models.sharding import Shard, recording  # noqa: E402
from tests.support.ranks import run_ranks  # noqa: E402
from tests.support.scenario import Scenario  # noqa: E402
from tests.unit.test_tp_engine import BLOCK_SIZES, BLOCK_SIZE, K, MAX_MODEL_LEN, METHODS, NUM_BLOCKS  # noqa: E402
from tests.unit.test_tp_engine import engine_config, write_heads  # noqa: E402

Q = K + 1
# a prefill, then decode steps (the padded drafter batch: k + 1 tokens a request, rejections marked)
PLANS = ([(0, 9, 0), (1, 12, 0), (2, 5, 0)],
         [(0, Q, 1), (1, Q, 0), (2, Q, 2)],
         [(0, Q, 0), (1, Q, 3), (2, Q, 1)])


def greedy_drafts(rank: int, world: int, root: str, graphs: bool, device: str = "cpu"
                  ) -> dict[str, list[torch.Tensor]]:
    """Per method: the greedy drafts of every call of PLANS on one rank (world 1 with graphs=False:
    the unsharded eager reference); with graphs, also [calls the graphs answered, of which by one
    combined graph].  On a GPU the engine captures real CUDA graphs (tests/gpu/test_tp_gpu.py)."""
    out = {}
    for method in METHODS:
        d = Path(root) / method
        cfg = replace(engine_config(method, device), max_num_seqs=4, max_num_batched_tokens=32, capture_sizes=(4,),
                      token_capture_sizes=(16, 32), attention_backend="triton" if graphs else "reference",
                      skinny_gemm="off")  # cuBLAS / torch GEMMs: no skinny kernel to time or interpret
        engine = DraftEngine.from_dirs(d / "head", d / "target", cfg, shard=Shard(rank, world))
        if graphs and engine.device.type == "cpu":
            engine.graphs = GraphRunner(engine, emulate=True)
        assert (engine.graphs is not None) == graphs
        assert getattr(engine.head, "fused", False) == (graphs and method != "deepseek_mtp")  # shard_fusion
        spec = engine.spec
        sizes = BLOCK_SIZES.get(method, (BLOCK_SIZE,))
        scn = Scenario(block_sizes=sizes, num_blocks=(NUM_BLOCKS,) * len(sizes), vocab_size=spec.vocab_size,
                       hidden_width=spec.hidden_input_width, k=K, max_model_len=MAX_MODEL_LEN, seed=9)
        out[method] = [engine.propose(**scn.call(plan).kwargs).draft_token_ids for plan in PLANS]
        if graphs:
            out[method].append(torch.tensor([engine.graphs.replays, engine.graphs.combined_replays]))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_graphs")
    write_heads(root)
    return str(root)


def test_sharded_graph_path_drafts_what_one_eager_process_drafts(tiny):
    single = greedy_drafts(0, 1, tiny, False)
    for rank_out in run_ranks(greedy_drafts, 2, tiny, True, timeout=600.0):
        for method in METHODS:
            *drafts, replays = rank_out[method]
            assert replays.tolist() == [len(PLANS), len(PLANS) - 1], method  # decode steps: one combined graph
            for got, want in zip(drafts, single[method]):
                assert torch.equal(got, want), method


def _picks(rank: int, world: int, rows: torch.Tensor) -> tuple[torch.Tensor, list]:
    shard = Shard(rank, world)
    local = rows.shape[1] // world
    calls = []
    with recording(calls):
        ids = shard.greedy_ids(rows[:, rank * local:(rank + 1) * local])
    return ids, calls


def test_vocab_parallel_greedy_pick_is_torch_argmax_ties_included():
    rows = torch.randn(6, 16)
    rows[1, 3] = rows[1, 12] = 9.0  # a tie across ranks 0 and 3 (world 4): the lower id wins
    rows[2, 5] = rows[2, 6] = 9.0  # a tie inside rank 1
    rows[3] = 0.0  # every id ties: id 0
    rows[4, 15] = 9.0  # the last id of the last rank
    rows[5, 8] = rows[5, 0] = float("inf")
    want = rows.argmax(dim=-1)
    assert want[:4].tolist()[1:] == [3, 5, 0]
    for ids, calls in run_ranks(_picks, 4, rows):
        assert torch.equal(ids, want)
        assert calls == [("all_gather", (6, 2), torch.float32)]  # one [tokens, 2] gather, not [tokens, vocab]
