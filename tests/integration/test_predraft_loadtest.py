"""`drafter loadtest --predraft` (issue 23): a spawned tiny drafter with pushed pre-drafts, one
simulated target session without and then with pre-drafting; the report has both runs, pushed
sets are picked (hit rate by accepted length), and the flag refuses transports without pushes."""

from __future__ import annotations

import json

from coordinator.loadtest.cli import main


def test_loadtest_predraft_reports_both_runs(tmp_path, capsys):
    out = tmp_path / "lt"
    rc = main(["--predraft", "--spawn-server", "--tiny", "eagle3", "--device", "cpu", "--duration", "4",
               "--warmup", "1", "--verify-ms", "120", "--predraft-batch", "2", "--out", str(out), "--quiet"])
    printed = capsys.readouterr().out
    print(printed)
    assert rc == 0
    runs = json.loads((out / "predraft.json").read_text())["runs"]
    exact, pre = runs
    assert not exact["predraft"] and pre["predraft"] and not exact["errors"] and not pre["errors"]
    assert exact["steps_per_s"] > 0 and exact["draft_latency_us"]["p50"] > 0
    assert pre["hit_rate"] > 0 and pre["hit_rate_by_a"] and pre["steps_per_s"] > 0
    assert "pre-draft" in printed and "exact" in printed


def test_loadtest_predraft_needs_zmq(capsys):
    assert main(["--predraft", "--transport", "grpc", "--endpoint", "127.0.0.1:1"]) == 2
    assert "--predraft" in capsys.readouterr().err
