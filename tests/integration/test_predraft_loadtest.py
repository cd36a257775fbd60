"""`drafter loadtest --predraft` (issue 23): a spawned tiny drafter with pushed pre-drafts, one
simulated target session without and then with pre-drafting; the report has both runs, pushed
sets are picked (hit rate by accepted length), and the flag refuses transports without pushes."""

from __future__ import annotations

import json

from coordinator.loadtest.cli import main


def test_loadtest_predraft_reports_both_runs(tmp_path, capsys):
    """The subject is the report, not the speed: a per-call deadline of 30 s (--predraft's floor is 10 s; a
    missed one is a session's error) and, for the pushed sets, a hit or a set that came after its 120 ms
    verification ended (a starved drafter pre-drafts slower than that: which of the two is the clock's)."""
    out = tmp_path / "lt"
    rc = main(["--predraft", "--spawn-server", "--tiny", "eagle3", "--device", "cpu", "--duration", "4",
               "--warmup", "1", "--verify-ms", "120", "--predraft-batch", "2", "--timeout", "30", "--out", str(out),
               "--quiet"])
    printed = capsys.readouterr().out
    print(printed)
    assert rc == 0
    runs = json.loads((out / "predraft.json").read_text())["runs"]
    exact, pre = runs
    assert not exact["predraft"] and pre["predraft"] and not exact["errors"] and not pre["errors"]
    assert exact["steps_per_s"] > 0 and exact["draft_latency_us"]["p50"] > 0
    assert pre["hit_rate_by_a"] and pre["steps_per_s"] > 0  # rows verified, sets looked up
    assert pre["hit_rate"] > 0 or pre["late_sets"] > 0, pre  # pushed sets came: picked, or after their pick
    assert "pre-draft" in printed and "exact" in printed


def test_loadtest_predraft_needs_zmq(capsys):
    assert main(["--predraft", "--transport", "grpc", "--endpoint", "127.0.0.1:1"]) == 2
    assert "--predraft" in capsys.readouterr().err
