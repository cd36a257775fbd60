"""bench/probe_host_ring.py times every piece against its child and derives the bound from them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[2] / "bench" / "probe_host_ring.py"
PIECES = {"d2h", "h2d", "zmq_tcp", "zmq_ipc", "stream_tcp", "stream_tcp_2", "stream_tcp_4", "stream_tcp_8",
          "stream_unix", "stream_unix_4", "stream_tcp_timeout_mode"}


def test_every_piece_is_timed_and_the_bound_follows_from_the_fastest(tmp_path):
    subprocess.run([sys.executable, str(PROBE), "--batches", "1,4", "--width", "256", "--steps", "4",
                    "--inprocess-us", "100,200", "--out", str(tmp_path)], check=True, timeout=120, capture_output=True)
    result = json.loads((tmp_path / "host_ring_probe.json").read_text())
    rows, limit = result["rows"], result["bound"]
    assert set(rows) == {"1", "4"}
    for row in rows.values():
        assert set(row) == PIECES | {"bytes"} and all(row[p]["n"] == 4 for p in PIECES)
    top = rows["4"]
    assert limit["gb_per_s"] == top["bytes"] / top[limit["path"]]["p50_us"] / 1e3
    assert top[limit["path"]]["p50_us"] == min(top[p]["p50_us"] for p in ("zmq_tcp", "stream_tcp", "stream_tcp_2",
                                                                          "stream_tcp_4", "stream_tcp_8"))
    lanes = {"1": "stream_tcp", "2": "stream_tcp_2", "4": "stream_tcp_4", "8": "stream_tcp_8"}
    assert {n: by["4"] for n, by in limit["lanes_gb_per_s"].items()} == {
        n: top["bytes"] / top[p]["p50_us"] / 1e3 for n, p in lanes.items()}, "the bandwidth table, by lanes"
    assert limit["4"]["best_ratio"] == (200 + limit["4"]["transfer_us"]) / 200
    text = (tmp_path / "host_ring_probe.md").read_text()
    assert "| 4 |" in text and "| 8 |" in text and "by lanes" in text
