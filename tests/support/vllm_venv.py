"""Where the vLLM 0.32 (CPU) venv's python is, for tests that run code inside it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def vllm_python() -> str:
    """The venv's python; skips when the vLLM stage did not run, fails when it ran but the venv is gone."""
    if not os.environ.get("DRAFTER_VLLM_RECORDINGS"):
        pytest.skip("the vLLM stage did not run: scripts/test.sh builds .venv-vllm and sets "
                    "DRAFTER_VLLM_RECORDINGS (or set it yourself, with DRAFTER_VLLM_PYTHON)")
    py = os.environ.get("DRAFTER_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not Path(py).exists():
        pytest.fail(f"vLLM venv python {py} is missing although the vLLM stage ran")
    return py
