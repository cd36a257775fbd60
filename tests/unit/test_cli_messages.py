"""What a user reads: the demo's drafter lines, `drafter bench` without a GPU and --replot, help texts."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from coordinator.demo.cli import drafter_lines


def test_demo_header_shows_each_drafter_as_started_and_its_restart():
    started = [("drafter-a", 100, 5001, 6001, 11), ("drafter-b", 200, 5002, 6002, 22)]
    now = [SimpleNamespace(pid=100, epoch=11), SimpleNamespace(pid=300, epoch=33)]  # b was killed, restarted
    a, b = drafter_lines(started, now)
    assert a == "drafter-a: pid 100, gRPC :5001, ZMQ :6001, epoch 11"
    assert b == "drafter-b: pid 200, gRPC :5002, ZMQ :6002, epoch 22 (restarted: pid 300, epoch 33)"


def test_every_bench_option_has_help():
    from drafter.tools.bench import grid as bench

    p = argparse.ArgumentParser()
    bench._arguments(p)
    missing = [a.option_strings for a in p._actions if a.option_strings and a.help in (None, "")]
    assert missing == []


def test_bench_without_a_gpu_points_at_recorded_results(monkeypatch):
    import torch

    from drafter.tools.bench import grid as bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bench.main([])
    assert "bench/results/" in str(e.value.code) and "--replot" in str(e.value.code)


def test_replot_says_what_it_wrote(tmp_path, capsys, monkeypatch):
    from drafter.tools.bench import grid as bench

    drawn = []
    monkeypatch.setattr(bench, "plot", lambda rows, meta, path: drawn.append(path))
    src = tmp_path / "bench.json"
    src.write_text(json.dumps({"rows": [{}, {}], "meta": {"device": "H100", "date": "2026-11-22"}}))
    assert bench.main(["--replot", str(src)]) == 0
    assert drawn == [tmp_path / "bench.png"]
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'bench.png'} (2 rows of H100, 2026-11-22)"
    with pytest.raises(SystemExit) as e:
        bench.main(["--replot", str(tmp_path / "missing.json")])
    assert "not a readable bench.json" in str(e.value.code)
