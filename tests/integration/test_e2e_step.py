"""coordinator.bench.e2e_step --tiny: the end-to-end step bench's own code on the CPU.

The reference target (tiny Llama) steps with no drafter, with free drafts, with the in-process
drafter and with a real `drafter serve` subprocess (loopback ZMQ; a CPU drafter has no graphs, so
it refuses the Bind and the steps go unbound); the in-process and the remote drafts must be equal
step by step, and the json must hold every figure the md prints.
"""

from __future__ import annotations

import json

from coordinator.bench.e2e_step import LABELS, compare_drafts, derive, main

WAYS = "plain,free_drafts,inprocess,remote"
ITERS = 3


def test_tiny_run_drafts_equal_in_process_and_remote_and_the_md_prints_the_json(tmp_path):
    assert main(["--tiny", "--device", "cpu", "--out", str(tmp_path), "--batch", "2", "--ctx", "8",
                 "--warmup", "1", "--iters", str(ITERS), "--ways", WAYS]) == 0
    data = json.loads((tmp_path / "e2e_step.json").read_text())
    ways = data["ways"]
    assert set(ways) == set(WAYS.split(",")) and not [w["error"] for w in ways.values() if "error" in w]
    same = data["compare"]["inprocess_vs_remote"]
    assert same["equal"] and same["steps"] == ITERS, same
    assert ways["inprocess"]["distinct_draft_tokens"] > 1, "drafts that vary: equality is no accident"
    for name in ("inprocess", "remote"):
        w = ways[name]
        assert w["drafted_steps"] == w["full_steps"] == ITERS and not w["proposer"]["no_drafts"], w
        assert w["query_rows_per_step"] == 2 * 4
    assert ways["plain"]["query_rows_per_step"] == 2
    assert ways["remote"]["proposer"]["steps"]["unbound"] >= ITERS  # the CPU drafter refused the Bind
    md = (tmp_path / "e2e_step.md").read_text()
    meta = data["meta"]
    assert meta["device"] in md.splitlines()[0] and meta["date"] in md.splitlines()[0] and meta["command"] in md
    for name, w in ways.items():
        assert f"| {LABELS[name]} | {w['step']['p50_us']:.0f} | {w['step']['p99_us']:.0f} |" in md
    share = data["derived"]["remote_over_inprocess_share"]
    assert f"**{100 * share:+.1f} %**" in md
    p50 = {n: w["step"]["p50_us"] for n, w in ways.items()}
    assert share == (p50["remote"] - p50["inprocess"]) / p50["inprocess"]
    assert f"**{data['derived']['remote_minus_plain_us']:.0f} us**" in md
    for outputs in (v for k, v in data["compare"].items() if k.startswith("outputs_")):
        assert outputs["requests_agreeing"] == outputs["requests"] == 2  # speculation never changes the output


def test_compare_names_the_first_step_whose_drafts_differ():
    base = {"drafts": [[[1, 2, 3]], [[4, 5, 6]], [[7, 8, 9]]], "outputs": {0: [1, 2]}}
    other = {"drafts": [[[1, 2, 3]], [[4, 5, 0]], [[7, 8, 9]]], "outputs": {0: [1, 3]}}
    got = compare_drafts({"plain": {"outputs": {0: [1, 2]}}, "free_drafts": {"outputs": {0: [1, 3, 5]}},
                          "inprocess": base, "remote": other})
    assert got["outputs_remote_vs_free_drafts"] == {"requests_agreeing": 1, "requests": 1}  # a prefix agrees
    assert "outputs_plain_vs_free_drafts" not in got and "outputs_free_drafts_vs_plain" in got
    assert got["inprocess_vs_remote"] == {"equal": False, "steps": 3, "equal_steps": 2, "first_difference": 1}
    assert got["outputs_remote_vs_plain"] == {"requests_agreeing": 0, "requests": 1}
    assert got["outputs_inprocess_vs_plain"] == {"requests_agreeing": 1, "requests": 1}


def test_derive_the_share_of_remote_over_in_process():
    ways = {n: {"step": {"p50_us": v}} for n, v in (("plain", 100.0), ("free_drafts", 110.0), ("inprocess", 120.0),
                                                     ("remote", 150.0))}
    d = derive(ways)
    assert d["remote_over_inprocess_share"] == 0.25 and d["inprocess_minus_plain_us"] == 20.0
    assert d["remote_minus_free_drafts_us"] == 40.0 and "unbound_over_inprocess_share" not in d


def test_gemm_plans_of_two_engines_are_compared():
    import torch

    from coordinator.bench.e2e_step import TINY_HEAD, gemm_plan
    from drafter.models.fusion import fuse_head
    from drafter.models.spec import parse_head
    from drafter.tools.bench.grid import random_head

    head = fuse_head(random_head(parse_head(TINY_HEAD, "eagle3"), torch.device("cpu"), torch.float32), "on")
    plan = gemm_plan(head)
    assert "lm_head_gemm" in plan and "layers.0.mlp.gate_up_gemm" in plan and plan["lm_head_gemm"]["configs"]
    other = {**plan, "lm_head_gemm": {**plan["lm_head_gemm"], "configs": {}}}  # cuBLAS for every bucket
    ways = {n: {"drafts": [[[1, 2, 3]]], "gemm_plan": p} for n, p in (("inprocess", plan),
                                                                      ("inprocess_trusted", other))}
    assert compare_drafts(ways)["inprocess_vs_inprocess_trusted"]["same_gemm_plan"] is False
    ways["inprocess_trusted"]["gemm_plan"] = gemm_plan(head)
    assert compare_drafts(ways)["inprocess_vs_inprocess_trusted"]["same_gemm_plan"] is True
