"""Remote drafts equal in-process engine drafts, over gRPC unary, gRPC stream and ZMQ.

Real `drafter serve` processes on loopback; every session replays the same realistic decode
(prefills over several blocks, rejections, a request driven past max_model_len) that an
in-process DraftEngine with the same settings replays alone.
"""

from __future__ import annotations

import json

import pytest
import torch

from coordinator.transport import GrpcDrafterClient, ZmqDrafterClient
from tests.integration.conftest import K, MML, SERVER_SETTINGS, SESSION_BLOCKS, reference_engine
from tests.support.engines import BLOCK_SIZES, tiny_dirs
from tests.support.scenario import Scenario
from tests.support.servers import DrafterServer, layout_for

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def plans():
    q = K + 1
    yield [(0, 5, 0), (1, 37, 0), (2, 1, 0)]
    yield [(0, q, 1), (1, q, 0), (2, 20, 0)]
    yield [(1, q, q - 1), (0, q, 0), (2, q, 2), (3, 70, 0)]
    for _ in range(2):
        yield [(0, q, q // 2), (3, q, 0), (1, q, 1)]
    yield [(3, MML - 70 - 2 * q - 2, 0)]
    yield [(3, 2, 0), (2, q, 0)]  # request 3's drafts run past max_model_len


def scenario(engine, seed: int) -> Scenario:
    return Scenario(block_sizes=engine.limits.block_sizes, num_blocks=(SESSION_BLOCKS,) * len(engine.limits.block_sizes),
                    vocab_size=engine.spec.vocab_size, hidden_width=engine.spec.hidden_input_width,
                    k=engine.config.num_speculative_tokens, max_model_len=MML, seed=seed,
                    draft_span=engine.limits.draft_span)


class _StreamClient:
    """A gRPC client whose propose goes over ProposeStream."""

    def __init__(self, target):
        self.client = GrpcDrafterClient(target, timeout_s=30)
        self.stream = None

    def info(self):
        return self.client.info()

    def attach(self, layout):
        out = self.client.attach(layout)
        self.stream = self.client.stream()
        return out

    def propose(self, **kw):
        return self.stream.propose(**kw)

    def detach(self):
        self.stream.close()
        return self.client.detach()

    def close(self):
        self.client.close()


def clients(server):
    return {"grpc-unary": GrpcDrafterClient(server.grpc_target, timeout_s=30),
            "grpc-stream": _StreamClient(server.grpc_target),
            "zmq": ZmqDrafterClient(server.zmq_endpoint, timeout_s=30)}


def check_parity(server, tiny_root, head: str, **engine_config):
    """Each transport gets its own session and replays the whole decode; drafts must be equal."""
    steps = list(plans())
    for seed, (name, client) in enumerate(clients(server).items()):
        info = client.info()
        client.attach(layout_for(info, SESSION_BLOCKS))
        engine = reference_engine(tiny_root, head, **engine_config)
        remote_scn, local_scn = scenario(engine, seed), scenario(engine, seed)
        for i, plan in enumerate(steps):
            want_probs = i == 1 and not engine_config.get("speculative_token_tree")
            local = engine.propose(**local_scn.call(plan).kwargs, return_probs=want_probs)
            remote = client.propose(**remote_scn.call(plan).kwargs, return_probs=want_probs)
            assert remote.draft_token_ids.dtype == torch.int64
            assert torch.equal(remote.draft_token_ids, local.draft_token_ids), f"{name} step {i} plan {plan}"
            assert (remote.batch_padded, remote.tokens_padded) == (local.batch_padded, local.tokens_padded)
            if want_probs:
                assert remote.draft_probs.shape == local.draft_probs.shape
                assert torch.allclose(remote.draft_probs, local.draft_probs, atol=1e-6)
        assert client.detach() == SESSION_BLOCKS * len(info.limits.kv_groups)
        client.close()


def test_eagle3_remote_equals_in_process(eagle3_server, tiny_root):
    check_parity(eagle3_server, tiny_root, "eagle3")


@pytest.fixture(scope="module")
def two_group_server(tiny_root, tmp_path_factory, one_torch_thread):
    """A head with a full-attention and a sliding-window KV group, block sizes 16 and 8."""
    _, model = tiny_dirs(tiny_root, "eagle-2groups")
    with DrafterServer(model, "eagle", log_path=tmp_path_factory.mktemp("logs") / "server.log", kv_blocks=4 * SESSION_BLOCKS,
                       block_sizes=",".join(map(str, BLOCK_SIZES)), **SERVER_SETTINGS) as server:
        yield server


def test_two_kv_groups_remote_equals_in_process(two_group_server, tiny_root):
    check_parity(two_group_server, tiny_root, "eagle-2groups")


@pytest.fixture(scope="module")
def tree_server(tiny_root, tmp_path_factory, one_torch_thread):
    _, model = tiny_dirs(tiny_root, "eagle")
    with DrafterServer(model, "eagle", log_path=tmp_path_factory.mktemp("logs") / "server.log", kv_blocks=4 * SESSION_BLOCKS,
                       speculative_token_tree=json.dumps(TREE), **SERVER_SETTINGS) as server:
        yield server


def test_tree_remote_equals_in_process(tree_server, tiny_root):
    check_parity(tree_server, tiny_root, "eagle", speculative_token_tree=TREE)
