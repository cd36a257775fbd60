"""The plugin under vLLM's Model Runner V2: runs test_vllm_mrv2_inner.py with the vLLM venv's python.

vLLM is not importable in the test environment.  The vLLM stage of scripts/test.sh builds the venv
(tests/vllm_parity/setup_venv.sh, which installs this repository into it) and sets
DRAFTER_VLLM_RECORDINGS; without it this test skips, as the other vLLM tests do.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.vllm_venv import vllm_python

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
INNER = "tests/unit/test_vllm_mrv2_inner.py"


def test_mrv2_stand_in_in_the_vllm_venv(tmp_path):
    py = vllm_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTER_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_HOST_IP="127.0.0.1")
    log = tmp_path / "inner.log"
    with open(log, "wb") as f:
        proc = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", INNER,
                               "--basetemp", str(tmp_path / "inner")],
                              stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, timeout=1500)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"MRv2 tests failed in the vLLM venv; tail:\n{text[-8000:]}"
    # every inner test ran (none skipped): 2 engaged, 1 own class, 1 V1 config, 2 refusals, 2 x TP=1, 1 x TP=2
    last = [line for line in text.splitlines() if " passed" in line][-1]
    assert re.search(r"\b9 passed\b", last) and "skipped" not in last, text[-3000:]
