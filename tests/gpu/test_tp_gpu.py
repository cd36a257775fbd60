"""On GPUs: the tensor-parallel code paths with NCCL and CUDA graphs.

One GPU: `drafter bench --tensor-parallel-size 1` runs its spawned rank through a process group of
one (NCCL) with CUDA graphs, for both heads at tiny shapes.  Two or more GPUs (skipped otherwise):
NCCL ranks of DraftEngine draft what the single-process engine drafts (EAGLE-3, Llama-style MTP,
DeepSeek-V3 MTP, EAGLE-1; fp32) eagerly and through CUDA graphs with the collectives captured inside,
the bench runs at TP = 2 with graphs, and `drafter serve --tensor-parallel-size 2` serves the
single-process drafts over ZMQ from graphs; then a killed worker rank turns health NOT_SERVING and a
client's propose fails closed.  Nothing here can hang: the ranks dump their stacks (faulthandler,
after 3/4 of DRAFTER_TP_TEST_TIMEOUT_S, default 150 s) and are killed at that timeout, which fails
the test with what they printed; the bench's ranks the same (--dump-stacks-after, --rank-timeout).

    pytest -m gpu tests/gpu/test_tp_gpu.py
"""

from __future__ import annotations

import argparse
import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU host"),
]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL between them)")
# a rank not done by then is stuck: its stacks were dumped (STACKS_AFTER_S), it is killed and the test fails
RANK_TIMEOUT_S = float(os.environ.get("DRAFTER_TP_TEST_TIMEOUT_S", "150"))
STACKS_AFTER_S = 0.75 * RANK_TIMEOUT_S


def bench_args(out: Path, size: int) -> argparse.Namespace:
    from drafter.tools.bench import tp

    p = argparse.ArgumentParser()
    tp.add_arguments(p)
    return p.parse_args(["--tensor-parallel-size", str(size), "--device", "cuda", "--heads",
                         "deepseek-tiny,eagle3-tiny", "--batches", "1,4", "--ks", "3", "--contexts", "64",
                         "--iters", "3", "--out", str(out), "--dump-stacks-after", str(STACKS_AFTER_S),
                         "--rank-timeout", str(RANK_TIMEOUT_S)])


def test_bench_runs_one_rank_through_the_tensor_parallel_code(tmp_path):
    from drafter.tools.bench import tp

    rows = tp.run(bench_args(tmp_path, 1))["rows"]
    assert len(rows) == 4 and all(r["drafts_agree"] and r["graphs"] and r["world"] == 1 for r in rows)
    assert all(r["peak_bytes"] > 0 for r in rows)


@TWO_GPUS
def test_bench_runs_two_nccl_ranks(tmp_path):
    from drafter.tools.bench import tp

    rows = tp.run(bench_args(tmp_path, 2))["rows"]
    assert rows and all(r["drafts_agree"] and r["world"] == 2 and r["graphs"] for r in rows)
    assert all(r["nccl_us"] > 0 for r in rows)


def _rank(rank: int, world: int, port: int, root: str, out: str, graphs: bool, on_gpu: bool = True) -> None:
    """One NCCL rank: greedy drafts through CUDA graphs (tests.unit.test_tp_graphs.greedy_drafts), or
    eager drafts with logits (tests.unit.test_tp_engine.drafts_of), pickled to out/."""
    from drafter.service.tp.worker import join_group, leave_group, loopback_collectives
    from tests.unit.test_tp_engine import drafts_of
    from tests.unit.test_tp_graphs import greedy_drafts

    loopback_collectives()  # NCCL's bootstrap on lo, as serve's ranks do (no other interface answers here)
    log = open(Path(out, f"{rank}.stacks"), "w")
    faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=False, file=log)
    try:
        device = f"cuda:{rank}" if on_gpu else "cpu"  # cpu: a gloo dry run of this harness
        join_group(rank, world, "127.0.0.1", port, "nccl" if on_gpu else "gloo", 120.0, device)
        if graphs:
            drafts = greedy_drafts(rank, world, root, True, device=device)
        else:
            drafts = drafts_of(rank, world, root, device=device)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(drafts))
        leave_group(torch.device(device))  # on a GPU: exits here (see leave_group)
    except BaseException:
        Path(out, f"{rank}.err").write_text(traceback.format_exc())
        raise


def run_nccl_ranks(root: Path, graphs: bool, world: int = 2, on_gpu: bool = True) -> list:
    """_rank on `world` spawned processes (cuda:0 ..); each rank's pickle.  A rank still running
    after RANK_TIMEOUT_S is killed and the test fails with every rank's error and stack dump."""
    from drafter.service.tp.worker import loopback_collectives, loopback_store

    loopback_collectives()
    store, listening = loopback_store(world, 120.0)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, store.port, str(root), str(root), graphs, on_gpu))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + RANK_TIMEOUT_S  # one bound for all ranks together
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        stuck = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(30)
        listening.close()
    said = "\n".join(f"--- {f.name}\n{f.read_text()}" for f in sorted(root.glob("*.err")) + sorted(root.glob("*.stacks")))
    assert not stuck, f"ranks {stuck} still running after {RANK_TIMEOUT_S} s (killed)\n{said}"
    assert all(p.exitcode == 0 for p in procs), f"rank exit codes {[p.exitcode for p in procs]}\n{said}"
    return [pickle.loads((root / f"{r}.pkl").read_bytes()) for r in range(world)]


@TWO_GPUS
def test_nccl_ranks_draft_through_graphs_what_one_gpu_drafts(tmp_path):
    from tests.unit.test_tp_engine import METHODS, write_heads
    from tests.unit.test_tp_graphs import PLANS, greedy_drafts

    write_heads(tmp_path)
    single = greedy_drafts(0, 1, str(tmp_path), False, device="cuda:0")  # fp32, eager reference, one GPU
    for graphs in run_nccl_ranks(tmp_path, graphs=True):
        for method in METHODS:
            *drafts, replays = graphs[method]
            assert replays.tolist() == [len(PLANS), len(PLANS) - 1], method  # every call a replay
            for got, want in zip(drafts, single[method]):
                assert torch.equal(got.cpu(), want.cpu()), f"{method} through graphs at TP=2"


@TWO_GPUS
def test_nccl_ranks_draft_eagerly_what_one_gpu_drafts(tmp_path):
    from tests.unit.test_tp_engine import METHODS, drafts_of, write_heads

    write_heads(tmp_path)
    single = drafts_of(0, 1, str(tmp_path), device="cuda:0")
    for eager in run_nccl_ranks(tmp_path, graphs=False):
        for method in METHODS:
            for (ids, logits), (ref_ids, ref_logits) in zip(eager[method], single[method]):
                assert torch.equal(ids.cpu(), ref_ids.cpu()), method
                assert torch.allclose(logits.cpu(), ref_logits.cpu(), atol=1e-3), method


def graph_replays(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("drafter_graph_replays_total{"))


@TWO_GPUS
def test_serve_on_two_gpus_serves_the_single_gpu_drafts_then_a_killed_rank_fails_closed(tmp_path):
    from coordinator.transport import ZmqDrafterClient
    from drafter.engine.engine import DraftEngine
    from drafter.wire.errors import Code, DrafterError
    from tests.integration.conftest import SESSION_BLOCKS
    from tests.integration.test_service_parity import plans
    from tests.integration.test_tp_serve import BLOCK_SIZE, NOT_SERVING, health, scenario
    from tests.support.servers import DrafterServer, layout_for
    from tests.unit.test_tp_engine import engine_config, write_heads

    write_heads(tmp_path)
    d = tmp_path / "eagle3"
    cfg = replace(engine_config("eagle3", "cuda:0"), attention_backend="reference")  # eager, one GPU
    engine = DraftEngine.from_dirs(d / "head", d / "target", cfg)
    server = DrafterServer(d, "eagle3", log_path=tmp_path / "serve.log", tensor_parallel_size=2, device="cuda:0",
                           dtype="float32", kv_blocks=4 * SESSION_BLOCKS, block_sizes=BLOCK_SIZE, max_model_len=96,
                           num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=256, skinny_gemm="off")
    try:
        server.start(timeout=RANK_TIMEOUT_S, until="ranks")
        ranks = server.ready
        server.ready = server.wait_for("ready", RANK_TIMEOUT_S)  # after every rank captured its graphs
        assert ranks["world"] == 2 and ranks["backend"] == "nccl"
        client = ZmqDrafterClient(server.zmq_endpoint, timeout_s=60)
        client.attach(layout_for(client.info(), SESSION_BLOCKS))
        local_scn, remote_scn = scenario(engine, 0), scenario(engine, 0)
        *served, after_kill = list(plans())
        for plan in served:
            local = engine.propose(**local_scn.call(plan).kwargs)
            remote = client.propose(**remote_scn.call(plan).kwargs)
            assert torch.equal(remote.draft_token_ids, local.draft_token_ids.cpu())
        assert graph_replays(server.metrics_url) > 0  # the leader drafted through its graphs
        os.kill(ranks["worker_pids"][0], signal.SIGKILL)
        failed = server.wait_for("rank_failed", timeout=30)  # the watch sees the exit at once
        assert "rank 1" in failed["reason"]
        assert health(server.health_target) == NOT_SERVING
        assert health(server.health_target, "liveness") == NOT_SERVING
        with pytest.raises(DrafterError) as refused:
            client.propose(**remote_scn.call(after_kill).kwargs)
        assert refused.value.code == Code.UNAVAILABLE
        client.close()
    except BaseException:
        print(server.log_tail(8000), file=sys.stderr)
        raise
    finally:
        server.stop(timeout=60)
