"""The gRPC stubs are generated from proto/, never hand-edited, and never stale."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import drafter._proto  # noqa: F401 - generates the stubs in a fresh source checkout
from drafter._proto import build

REPO = Path(__file__).resolve().parents[2]
GENERATED = ("drafter_pb2.py", "drafter_pb2.pyi", "drafter_pb2_grpc.py")


def test_importable_stubs_match_a_fresh_generation(tmp_path):
    build.generate(tmp_path, REPO / "proto")
    importable = Path(build.OUT_ROOT) / "drafter" / "v1"
    for name in GENERATED:
        fresh = (tmp_path / "drafter" / "v1" / name).read_text()
        current = (importable / name).read_text()
        assert current == fresh, (f"{importable / name} is stale: regenerate it with "
                                  f"`python drafter/_proto/build.py` (or reinstall the package)")


def test_generated_stubs_are_not_committed():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "drafter/_proto"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    assert not [p for p in tracked if "_pb2" in p], tracked


def test_build_py_generates_the_stubs_into_the_package(tmp_path):
    """What `pip install .` runs: setup.py's build_py, on a tree that has no generated files yet."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("*_pb2*", "__pycache__")
    src.mkdir()
    for item in ("setup.py", "pyproject.toml"):
        shutil.copy(REPO / item, src / item)
    shutil.copytree(REPO / "proto", src / "proto", ignore=ignore)
    shutil.copytree(REPO / "drafter", src / "drafter", ignore=ignore)
    out = tmp_path / "build"
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)], cwd=src,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in GENERATED:
        built = out / "drafter" / "_proto" / "drafter" / "v1" / name
        assert built.exists(), f"build_py did not produce {built}"
        assert built.read_text() == (Path(build.OUT_ROOT) / "drafter" / "v1" / name).read_text()


def test_stubs_import_without_name_clash():
    from drafter._proto.drafter.v1 import drafter_pb2, drafter_pb2_grpc

    assert drafter_pb2.DESCRIPTOR.package == "drafter.v1"
    assert drafter_pb2.DESCRIPTOR.name == "drafter/v1/drafter.proto"
    assert hasattr(drafter_pb2_grpc, "DrafterStub")
