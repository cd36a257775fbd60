"""On GPUs: the tensor-parallel code paths with NCCL.

One GPU: `drafter bench --tensor-parallel-size 1` runs its spawned rank through a process group of
one (NCCL) with CUDA graphs, for both heads at tiny shapes.  Two or more GPUs (skipped otherwise):
NCCL ranks of DraftEngine draft what the single-process engine drafts (EAGLE-3, Llama-style MTP,
DeepSeek-V3 MTP), the bench runs at TP = 2, and `drafter serve --tensor-parallel-size 2` serves the
single-process drafts over ZMQ.

    pytest -m gpu tests/gpu/test_tp_gpu.py
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import traceback
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU host"),
]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL between them)")


def bench_args(out: Path, size: int) -> argparse.Namespace:
    from drafter.tools.bench import tp

    p = argparse.ArgumentParser()
    tp.add_arguments(p)
    return p.parse_args(["--tensor-parallel-size", str(size), "--device", "cuda", "--heads",
                         "deepseek-tiny,eagle3-tiny", "--batches", "1,4", "--ks", "3", "--contexts", "64",
                         "--iters", "3", "--out", str(out)])


def test_bench_runs_one_rank_through_the_tensor_parallel_code(tmp_path):
    from drafter.tools.bench import tp

    rows = tp.run(bench_args(tmp_path, 1))["rows"]
    assert len(rows) == 4 and all(r["drafts_agree"] and r["graphs"] and r["world"] == 1 for r in rows)
    assert all(r["peak_bytes"] > 0 for r in rows)


@TWO_GPUS
def test_bench_runs_two_nccl_ranks(tmp_path):
    from drafter.tools.bench import tp

    rows = tp.run(bench_args(tmp_path, 2))["rows"]
    assert all(r["drafts_agree"] and r["world"] == 2 and not r["graphs"] for r in rows)


def _rank(rank: int, world: int, port: int, root: str, out: str) -> None:
    from drafter.service.tp.worker import join_group
    from tests.unit.test_tp_engine import drafts_of

    try:
        join_group(rank, world, "127.0.0.1", port, "nccl", 120.0, f"cuda:{rank}")
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(drafts_of(rank, world, root, device=f"cuda:{rank}")))
        torch.distributed.destroy_process_group()
    except BaseException:
        Path(out, f"{rank}.err").write_text(traceback.format_exc())
        raise


@TWO_GPUS
def test_nccl_ranks_draft_what_one_gpu_drafts(tmp_path):
    from tests.unit.test_tp_engine import METHODS, drafts_of, write_heads

    write_heads(tmp_path)
    single = drafts_of(0, 1, str(tmp_path), device="cuda:0")
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, store.port, str(tmp_path), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    errors = [e.read_text() for e in tmp_path.glob("*.err")]
    assert not errors and all(p.exitcode == 0 for p in procs), errors
    for rank in range(2):
        out = pickle.loads((tmp_path / f"{rank}.pkl").read_bytes())
        for method in METHODS:
            for (ids, logits), (ref_ids, ref_logits) in zip(out[method], single[method]):
                assert torch.equal(ids.cpu(), ref_ids.cpu()), method
                assert torch.allclose(logits.cpu(), ref_logits.cpu(), atol=1e-3), method


@TWO_GPUS
def test_serve_on_two_gpus_serves_the_single_gpu_drafts(tmp_path):
    from coordinator.transport import ZmqDrafterClient
    from tests.integration.conftest import SESSION_BLOCKS
    from tests.integration.test_service_parity import plans
    from tests.integration.test_tp_serve import BLOCK_SIZE, scenario
    from tests.support.servers import DrafterServer, layout_for
    from tests.unit.test_tp_engine import engine_config, write_heads
    from drafter.engine.engine import DraftEngine

    write_heads(tmp_path)
    d = tmp_path / "eagle3"
    cfg = engine_config("eagle3", "cuda:0")
    engine = DraftEngine.from_dirs(d / "head", d / "target", cfg)
    with DrafterServer(d, "eagle3", log_path=tmp_path / "serve.log", tensor_parallel_size=2, device="cuda:0",
                       dtype="float32", kv_blocks=4 * SESSION_BLOCKS, block_sizes=BLOCK_SIZE, max_model_len=96,
                       num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=256) as server:
        client = ZmqDrafterClient(server.zmq_endpoint, timeout_s=120)
        client.attach(layout_for(client.info(), SESSION_BLOCKS))
        local_scn, remote_scn = scenario(engine, 0), scenario(engine, 0)
        for plan in plans():
            local = engine.propose(**local_scn.call(plan).kwargs)
            remote = client.propose(**remote_scn.call(plan).kwargs)
            assert torch.equal(remote.draft_token_ids, local.draft_token_ids.cpu())
        client.close()
