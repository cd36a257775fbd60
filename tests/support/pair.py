"""The target + head pair trained here (coordinator.target.distill), once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordinator.target.distill import DistillConfig, DistillReport, train_pair


def trained_pair(tmp_path_factory, method: str = "eagle3") -> tuple[Path, DistillReport]:
    root = tmp_path_factory.getbasetemp() / f"trained-pair-{method}"
    report = train_pair(root, DistillConfig(method=method))  # idempotent: later calls reuse the files
    return root, report


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny matmuls: one thread is ~10x faster than two OpenMP threads fighting over 2 busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
