"""The target + head pair trained here (coordinator.target.distill), once per test session."""

from __future__ import annotations

from pathlib import Path

from coordinator.target.distill import DistillConfig, DistillReport, train_pair


def trained_pair(tmp_path_factory, method: str = "eagle3") -> tuple[Path, DistillReport]:
    root = tmp_path_factory.getbasetemp() / f"trained-pair-{method}"
    report = train_pair(root, DistillConfig(method=method))  # idempotent: later calls reuse the files
    return root, report
