"""Start-up mistakes end in one line naming the flag, its value and what to do (issue 20, item 4).

Each case runs `drafter serve` (or the top-level CLI) as a user would, on loopback, and checks:
a non-zero exit, exactly one line on stderr, and that line names the flag and the value.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.support.engines import tiny_dirs
from tests.support.servers import REPO

ZERO_PORTS = ["--grpc-port", "0", "--zmq-port", "0", "--health-port", "0", "--metrics-port", "0"]


def _drafter(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTER_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "drafter", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)


def _one_line(run: subprocess.CompletedProcess, *words: str) -> str:
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert run.returncode != 0, run.stderr
    assert len(lines) == 1, run.stderr  # no traceback, no C-core log line
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def eagle3(tiny_root):
    return tiny_dirs(tiny_root, "eagle3")[1]


def _serve(model_dir, *extra: str, method: str = "eagle3") -> subprocess.CompletedProcess:
    return _drafter("serve", "--method", method, "--model", str(model_dir / "head"), "--target-model",
                    str(model_dir / "target"), "--device", "cpu", "--host", "127.0.0.1", "--log-format", "text",
                    *ZERO_PORTS, *extra)


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("flag", ["grpc-port", "zmq-port", "metrics-port", "health-port"])
def test_a_port_in_use(eagle3, busy_port, flag):
    run = _serve(eagle3, f"--{flag}", str(busy_port))
    line = _one_line(run, f"--{flag} {busy_port}", "already in use", "0 = any free port")
    assert line.startswith("drafter serve: ")


def test_eagle_method_on_an_eagle3_checkpoint(eagle3):
    _one_line(_serve(eagle3, method="eagle"), "--method eagle", str(eagle3 / "head"), "pass --method eagle3")


def test_a_refused_head_config_key_names_the_file_and_key(eagle3, tmp_path):
    """A key the engine refuses (an unknown rope type) is a --model problem, not a wrong --method."""
    import json
    import shutil

    shutil.copytree(eagle3, tmp_path / "m")
    cfg_path = tmp_path / "m" / "head" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["transformer_layer_config"]["rope_scaling"] = {"rope_type": "made_up", "factor": 2.0}
    cfg_path.write_text(json.dumps(cfg))
    line = _one_line(_serve(tmp_path / "m"), f"--model {tmp_path / 'm' / 'head'}", "made_up", "rope")
    assert "--method" not in line


def test_cuda_device_without_a_gpu(eagle3):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _one_line(_serve(eagle3, "--device", "cuda"), "--device cuda", "no CUDA GPU", "--device cpu")


def test_missing_model_directory(tmp_path):
    run = _drafter("serve", "--method", "eagle3", "--model", str(tmp_path / "nothing"), "--device", "cpu", *ZERO_PORTS)
    _one_line(run, f"--model {tmp_path / 'nothing'}", "no such directory")


def test_missing_target_model_names_the_flag(eagle3):
    run = _drafter("serve", "--method", "eagle3", "--model", str(eagle3 / "head"), "--device", "cpu",
                   "--log-format", "text", "--host", "127.0.0.1", *ZERO_PORTS)
    assert run.returncode != 0
    errors = [ln for ln in run.stderr.splitlines() if "ERROR" in ln]
    assert len(errors) == 1 and "--target-model" in errors[0] and "Traceback" not in run.stderr, run.stderr


# (a load test with no drafter listening: test_loadtest.py::test_no_drafter_listening_is_one_line_and_leaves_no_folder)


@pytest.mark.parametrize("argv, usage, near", [
    (["serve", "--grcp-port", "1"], "usage: drafter serve", "--grpc-port"),
    (["loadtest", "--durration", "1"], "usage: drafter loadtest", "--duration"),
    (["demo", "--chaoss"], "usage: drafter demo", "--chaos"),
])
def test_a_mistyped_flag_shows_the_subcommands_usage(argv, usage, near, capsys):
    from drafter import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith(usage), err[:200]
    assert f"did you mean {near}?" in err.splitlines()[-1]
