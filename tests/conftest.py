import os

import pytest
import torch

# Without a GPU, Triton kernels run under the interpreter; it must be chosen before any kernel
# module is imported, so it is set here, ahead of every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.support.triton_interp import install

    install()  # interpreter shortcuts that change no result (tests/support/triton_interp.py)

# scripts/test.sh runs the tests on pytest-xdist workers (one per core, a whole file to a worker).  A
# worker's OpenMP threads would only spin against the other worker's (and the servers' the tests
# start) on CI's two cores: one torch thread each.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# The files that take longest on CI's two cores, slowest first (measured 2026-11-26 with --durations;
# the files whose kernels run under the Triton interpreter scaled by what tests/support/triton_interp.py's
# shortcuts measured on them alone: ~0.7 for the first three, then 0.65-0.95 of CPU for the block-type
# and broadcast ones, which moved the soak and the load test ahead of some).  Under xdist they are handed out first, so that no worker is
# left running one of them alone at the end of the run; every other file keeps its place.  A stale list
# only costs time.
SLOW_FILES = (
    "tests/vllm_parity/test_plugin.py",
    "tests/vllm_parity/test_vllm_replay.py",
    "tests/e2e/test_docs_commands.py",
    "tests/integration/test_abuse_soak.py",
    "tests/unit/test_tp_graphs.py",
    "tests/integration/test_predraft_bound.py",
    "tests/integration/test_loadtest.py",
    "tests/unit/test_graph_runner.py",
    "tests/unit/test_triton_kernels.py",
    "tests/integration/test_predraft_bound_lossless.py",
    "tests/unit/test_vllm_mrv2.py",
    "tests/unit/test_bound_fold.py",
    "tests/integration/test_service_fuzz.py",
    "tests/integration/test_bound_ipc.py",
    "tests/integration/test_bound_armed.py",
    "tests/integration/test_coordinator_fleet.py",
    "tests/unit/test_bound.py",
    "tests/unit/test_vllm_mtp_runners.py",
    "tests/integration/test_ring_stream.py",
)


def pytest_collection_modifyitems(config, items):
    """Under xdist: the SLOW_FILES first (a stable sort: each file's own tests keep their order)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {path: i for i, path in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(SLOW_FILES)))


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    """Tiny checkpoints written once per test session (make-tiny layouts, never a hub)."""
    return tmp_path_factory.mktemp("tiny")
