"""The target + head pair trained here (coordinator.target.distill), once per test run."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
import torch

from coordinator.target.distill import DistillConfig, DistillReport, train_pair


def trained_pair(tmp_path_factory, method: str = "eagle3") -> tuple[Path, DistillReport]:
    """Under pytest-xdist once per run, not once per worker: the workers' base directories share the
    run's one parent, and a lock there lets the first worker train while another waits for its files."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / f"trained-pair-{method}"
    with open(shared / f"trained-pair-{method}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        report = train_pair(root, DistillConfig(method=method))  # idempotent: later calls reuse the files
    return root, report


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny matmuls: one thread is ~10x faster than two OpenMP threads fighting over 2 busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
