"""Shared real-server fixtures for the service's integration tests (loopback only)."""

from __future__ import annotations

import pytest
import torch

from tests.support.engines import build_engine, tiny_dirs
from tests.support.servers import DrafterServer

MML = 96  # max_model_len of every test server and reference engine
K = 3
MAX_NUM_SEQS = 8
MAX_TOKENS = 256
SESSION_BLOCKS = 64  # per session and KV group (the scenarios need ~13 blocks per request of 8-token blocks)
SERVER_SETTINGS = dict(num_speculative_tokens=K, max_model_len=MML, max_num_seqs=MAX_NUM_SEQS,
                       max_num_batched_tokens=MAX_TOKENS, torch_threads=1, max_sessions=64)


@pytest.fixture(scope="session")
def one_torch_thread():
    """Tiny models: OpenMP threads of this process would only spin against the servers' on 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def eagle3_server(tiny_root, tmp_path_factory, one_torch_thread):
    """One EAGLE-3 drafter shared by the parity, isolation, fuzz, metrics and health tests."""
    _, model = tiny_dirs(tiny_root, "eagle3")
    log = tmp_path_factory.mktemp("logs") / "eagle3-server.log"
    server = DrafterServer(model, "eagle3", log_path=log, kv_blocks=40 * SESSION_BLOCKS, block_sizes=16,
                           batch_window_us=500, **SERVER_SETTINGS)
    server.start()
    yield server
    code = server.stop()
    assert code == 0, f"the shared server exited with {code}: {server.log_tail()}"


def reference_engine(tiny_root, head: str = "eagle3", **config):
    """The in-process engine a session's drafts must equal: same config, a session-sized pool."""
    return build_engine(tiny_root, head, k=K, max_model_len=MML, num_blocks=SESSION_BLOCKS,
                        max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_TOKENS, **config)
