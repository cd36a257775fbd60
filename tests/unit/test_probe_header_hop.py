"""bench/probe_header_hop.py runs its three paths against its drafter-side child and reports each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from drafter.wire import doorbell

pytestmark = pytest.mark.skipif(not doorbell.available(), reason="abstract UNIX-domain sockets are Linux's")

PROBE = Path(__file__).resolve().parents[2] / "bench" / "probe_header_hop.py"
PATHS = ("zmq_tcp", "zmq_ipc", "doorbell")


def test_every_path_is_measured_on_its_own_steps(tmp_path):
    subprocess.run([sys.executable, str(PROBE), "--steps", "20", "--rounds", "2", "--warmup", "3", "--out",
                    str(tmp_path)], check=True, timeout=120, capture_output=True)
    result = json.loads((tmp_path / "header_hop.json").read_text())
    assert sorted(result) == sorted(PATHS)
    for path, r in result.items():
        for stage in ("header_hop", "reply_hop", "round_trip"):
            assert r[stage]["n"] == 40, (path, stage)
        assert 0 < r["header_hop"]["p50_us"] <= r["round_trip"]["p99_us"], path
    assert (tmp_path / "header_hop.md").read_text().count("|\n") == 2 + len(PATHS)
