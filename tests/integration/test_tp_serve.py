"""`drafter serve --tensor-parallel-size 2` (a leader and one spawned gloo worker, loopback): drafts over
ZMQ and gRPC equal the single-process engine's for EAGLE-3, Llama-style MTP and DeepSeek-V3 MTP; a
killed worker rank turns health NOT_SERVING (serving and liveness) and a client's propose fails closed."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.transport import GrpcDrafterClient, ZmqDrafterClient
from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.engine.engine import DraftEngine
from drafter.models.tiny import write_tiny
from drafter.models.tiny_deepseek import TinyDeepseekSizes, write_tiny_deepseek
from drafter.wire.errors import Code, DrafterError
from tests.integration.conftest import K, MAX_NUM_SEQS, MAX_TOKENS, MML, SERVER_SETTINGS, SESSION_BLOCKS
from tests.integration.test_service_parity import plans
from tests.support.scenario import Scenario
from tests.support.servers import DrafterServer, layout_for

METHODS = ("eagle3", "mtp", "deepseek_mtp")
BLOCK_SIZE = 16
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tp_heads")
    for method in METHODS:
        if method == "deepseek_mtp":  # 8 x 16 FP8 blocks: every rank's cut on a block edge
            write_tiny_deepseek(root / method, seed=5, sizes=TinyDeepseekSizes(fp8_block=(8, 16)))
        else:
            write_tiny(method, root / method, seed=3)
    return root


@pytest.fixture(scope="module")
def servers(heads, tmp_path_factory, one_torch_thread):
    """One TP=2 server per method (started in turn, stopped at the module's end)."""
    logs = tmp_path_factory.mktemp("tp_logs")
    out = {}
    try:
        for method in METHODS:
            server = DrafterServer(heads / method, method, log_path=logs / f"{method}.log", tensor_parallel_size=2,
                                   kv_blocks=4 * SESSION_BLOCKS, block_sizes=BLOCK_SIZE, **SERVER_SETTINGS)
            server.start(until="ranks")
            server.ranks = server.ready
            server.ready = server.wait_for("ready", 120)
            out[method] = server
        yield out
    finally:
        codes = {method: server.stop() for method, server in out.items()}
    assert codes == {method: 0 for method in out}, f"a TP server did not drain cleanly: {codes}"


def health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def reference(heads: Path, method: str) -> DraftEngine:
    cfg = EngineConfig(method=method, num_speculative_tokens=K, max_model_len=MML, max_num_seqs=MAX_NUM_SEQS,
                       max_num_batched_tokens=MAX_TOKENS, kv_groups=(KVGroupSpec(BLOCK_SIZE, SESSION_BLOCKS),))
    return DraftEngine.from_dirs(heads / method / "head", heads / method / "target", cfg)


def scenario(engine: DraftEngine, seed: int) -> Scenario:
    return Scenario(block_sizes=(BLOCK_SIZE,), num_blocks=(SESSION_BLOCKS,), vocab_size=engine.spec.vocab_size,
                    hidden_width=engine.spec.hidden_input_width, k=K, max_model_len=MML, seed=seed,
                    draft_span=engine.limits.draft_span)


@pytest.mark.parametrize("method", METHODS)
def test_two_ranks_serve_the_single_process_drafts(servers, heads, method):
    server = servers[method]
    assert server.ranks["world"] == 2 and server.ranks["backend"] == "gloo"
    engine = reference(heads, method)
    for seed, client in enumerate((GrpcDrafterClient(server.grpc_target, timeout_s=60),
                                   ZmqDrafterClient(server.zmq_endpoint, timeout_s=60))):
        info = client.info()
        client.attach(layout_for(info, SESSION_BLOCKS))
        local_scn, remote_scn = scenario(engine, seed), scenario(engine, seed)
        for i, plan in enumerate(plans()):
            want_probs = i == 1
            local = engine.propose(**local_scn.call(plan).kwargs, return_probs=want_probs)
            remote = client.propose(**remote_scn.call(plan).kwargs, return_probs=want_probs)
            assert torch.equal(remote.draft_token_ids, local.draft_token_ids), f"{method} {type(client)} step {i}"
            if want_probs:
                assert torch.allclose(remote.draft_probs, local.draft_probs, atol=1e-5)
        assert client.detach() == SESSION_BLOCKS  # its blocks wiped on every rank
        client.close()


def listening_addresses(pid: int) -> set[str]:
    """Local addresses of the TCP sockets process `pid` listens on (from /proc: no tool needed)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.add(fields[1].rsplit(":", 1)[0])
    return found


def test_every_rank_listens_on_loopback_only(servers):
    server = servers["eagle3"]
    # 127.0.0.1, ::1 and ::ffff:127.0.0.1 as /proc spells them
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    for pid in [server.proc.pid] + server.ranks["worker_pids"]:
        addresses = listening_addresses(pid)
        assert addresses and addresses <= loopback, (pid, addresses)


def test_a_killed_rank_takes_the_server_out_of_service(servers, heads):
    server = servers["deepseek_mtp"]
    client = ZmqDrafterClient(server.zmq_endpoint, timeout_s=60)
    client.attach(layout_for(client.info(), SESSION_BLOCKS))
    engine = reference(heads, "deepseek_mtp")
    scn = scenario(engine, 3)
    steps = plans()
    client.propose(**scn.call(next(steps)).kwargs)  # serving before the kill
    os.kill(server.ranks["worker_pids"][0], signal.SIGKILL)
    failed = server.wait_for("rank_failed", timeout=30)  # the bound: the watch sees the exit at once
    assert "rank 1" in failed["reason"]
    assert health(server.health_target) == NOT_SERVING
    assert health(server.grpc_target) == NOT_SERVING
    assert health(server.health_target, "liveness") == NOT_SERVING  # a probe restarts it
    with pytest.raises(DrafterError) as refused:
        client.propose(**scn.call(next(steps)).kwargs)
    assert refused.value.code == Code.UNAVAILABLE
    client.close()


@pytest.mark.parametrize("size, says", [(3, "num_attention_heads: 4 does not split evenly over 3 ranks"),
                                        (8, "num_attention_heads: 4 does not split evenly over 8 ranks")])
def test_a_size_that_does_not_divide_the_head_is_refused_naming_flag_and_key(heads, size, says):
    from drafter.service.config import ServerConfig
    from drafter.service.startup import StartupError, preflight

    cfg = ServerConfig(method="eagle3", model=str(heads / "eagle3" / "head"), device="cpu",
                       target_model=str(heads / "eagle3" / "target"), tensor_parallel_size=size)
    with pytest.raises(StartupError, match=f"--tensor-parallel-size {size}: .*{says}"):
        preflight(cfg)


@pytest.mark.parametrize("size, method, other", [(0, "eagle3", {}), (2, "extract_hidden_states", {}),
                                                 (2, "eagle3", {"weights": "fp8"})])
def test_the_flag_is_checked_at_the_edge(size, method, other):
    from drafter.service.config import ServerConfig

    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        ServerConfig(method=method, model="m", tensor_parallel_size=size, **other).check()
