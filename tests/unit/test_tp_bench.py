"""`drafter bench --tensor-parallel-size N` on CPU (gloo ranks, tiny shapes of both heads): every rank
runs the same calls through the engine, the rows say whether their drafts agreed, bench_tp.json is
written; a disagreement between ranks is reported, not hidden."""

from __future__ import annotations

import argparse
import json

from drafter.tools.bench import tp


def args(tmp_path, size: int) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    tp.add_arguments(p)
    return p.parse_args(["--tensor-parallel-size", str(size), "--device", "cpu", "--heads", "deepseek-tiny,eagle3-tiny",
                         "--batches", "1,2", "--ks", "2", "--contexts", "40", "--iters", "1", "--no-eager",
                         "--out", str(tmp_path)])


def test_two_ranks_time_both_heads_and_draft_alike(tmp_path):
    result = tp.run(args(tmp_path, 2))
    rows = result["rows"]
    assert [(r["head"], r["batch"]) for r in rows] == [("deepseek-tiny", 1), ("deepseek-tiny", 2),
                                                       ("eagle3-tiny", 1), ("eagle3-tiny", 2)]
    assert all(r["world"] == 2 and r["drafts_agree"] and r["propose_us"] > 0 for r in rows)
    assert json.loads((tmp_path / "bench_tp.json").read_text())["meta"]["tensor_parallel_size"] == 2


def test_ranks_that_draft_differently_are_reported():
    row = dict(head="h", k=1, ctx=8, batch=1, world=2, graphs=False, weight_bytes=4, propose_us=1.0, bcast_us=1.0)
    same = tp.merge([[{**row, "rank": 0, "drafts": [[1]]}], [{**row, "rank": 1, "drafts": [[1]]}]])
    differ = tp.merge([[{**row, "rank": 0, "drafts": [[1]]}], [{**row, "rank": 1, "drafts": [[2]]}]])
    assert same[0]["drafts_agree"] and not differ[0]["drafts_agree"]


def test_drafter_bench_hands_the_flag_to_the_tp_bench(tmp_path):
    from drafter.tools.bench import grid

    p = argparse.ArgumentParser()
    grid._arguments(p)
    ns = p.parse_args(["--tensor-parallel-size", "1", "--device", "cpu", "--heads", "eagle3-tiny", "--batches", "1",
                       "--ks", "1", "--contexts", "20", "--iters", "1", "--no-eager", "--out", str(tmp_path)])
    rows = grid.run(ns)["rows"]
    assert [(r["head"], r["world"], r["drafts_agree"]) for r in rows] == [("eagle3-tiny", 1, True)]
