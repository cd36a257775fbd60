"""`drafter bench --tensor-parallel-size 1,2` on CPU (gloo ranks, the tiny EAGLE-3 head): both sizes run in
one invocation, the N = 2 row carries its speedup over the N = 1 row, the time of its step's collectives
alone and a smaller per-rank floor; every row is in rows.jsonl as it finished; the floor's byte count
follows its rule (weights read per forward pass, embedding rows of the tokens, fc once, KV per request);
a rank that fails ends the run at once (the others killed), not after a peer's timeout."""

from __future__ import annotations

import argparse
import json

import pytest

from drafter.tools.bench import tp


def test_one_run_compares_one_and_two_ranks(tmp_path):
    p = argparse.ArgumentParser()
    tp.add_arguments(p)
    args = p.parse_args(["--tensor-parallel-size", "1,2", "--device", "cpu", "--heads", "eagle3-tiny", "--batches",
                         "1", "--ks", "1", "--contexts", "40", "--iters", "1", "--no-eager", "--out", str(tmp_path)])
    rows = tp.run(args)["rows"]
    one, two = rows
    assert (one["world"], two["world"]) == (1, 2) and one["drafts_agree"] and two["drafts_agree"]
    assert "speedup" not in one and two["speedup"] == pytest.approx(one["propose_us"] / two["propose_us"])
    assert "nccl_us" not in one and two["nccl_us"] > 0
    assert 0 < two["floor_bytes"] < one["floor_bytes"]
    streamed = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["world"], r["propose_us"]) for r in streamed] == [(1, one["propose_us"]), (2, two["propose_us"])]
    table = (tmp_path / "bench_tp.md").read_text().splitlines()
    assert len(table) == 4 and table[3].startswith("| eagle3-tiny | 1 | 40 | 1 | 2 |")
    assert f"| {two['speedup']:.2f} |" in table[3]


def test_floor_bytes_count_what_a_step_reads():
    import torch

    from drafter.models.sharding import SINGLE

    head, spec = tp.build_head("eagle3-tiny", SINGLE, torch.device("cpu"), torch.float32, False)
    cache = torch.zeros(2, 4, 16, 2, 16)  # [2, blocks, block_size, kv_heads, head_dim]: 256 bytes a token

    class Engine:
        class kv:
            layers = [cache]

    named = dict(list(head.named_parameters()) + list(head.named_buffers()))
    size = {n: t.numel() * t.element_size() for n, t in named.items()}
    dense = sum(v for n, v in size.items() if not n.startswith(("fc.", "embed_tokens.")))
    row = size["embed_tokens.weight"] // spec.vocab_size
    k, batch, ctx = 3, 2, 40
    want = size["fc.weight"] + sum(dense + tokens * row + batch * ctx * 256 for tokens in (batch * 4, batch, batch))
    assert tp.propose_bytes(head, Engine, k, batch, ctx) == want


def _stuck_rank(plan, pipe) -> None:
    """Rank 1 fails at once; rank 0 would wait forever (as in a collective whose peer died)."""
    if plan.rank == 1:
        pipe.send(("failed", "rank 1: boom"))
        raise SystemExit(1)
    import threading

    threading.Event().wait()  # never set: stuck until killed


def test_a_failed_rank_fails_the_run_at_once_and_kills_the_rest(monkeypatch):
    monkeypatch.setattr(tp, "rank_main", _stuck_rank)
    plan = tp.Plan(0, 2, 0, "cpu", ("eagle3-tiny",), (1,), (1,), (40,), 1, False, False, rank_timeout_s=300.0)
    with pytest.raises(SystemExit, match="rank 1: boom"):  # rank 1's failure, not rank 0's 300 s timeout
        tp.spawn_ranks(plan)
