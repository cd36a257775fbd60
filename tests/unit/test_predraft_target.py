"""coordinator.bench.predraft_target, the simulated target of issue 23's GPU measurement, on CPU:
its calls are ones the drafter reads the right outcomes from, the pushed pre-drafts are found
and used (every row a hit: the call goes out without waiting), pushes that come after the pick
are never used, and the acceptance arithmetic behind the draws.  The drafter side is the real
engine and the real PreDraftService over an in-memory "socket" (no server, no timing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from coordinator.bench.predraft_target import (Assumptions, ExactRemote, InProcess, PreDraft, PreDraftNoWait, Rows,
                                               SimConfig, Verify, run)
from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.engine.engine import DraftEngine
from drafter.service.predraft import PreDraftService
from drafter.tools.bench.grid import random_head
from drafter.tools.bench.predraft import TINY
from drafter.wire.predraft import outcomes_of_call
from drafter.wire.records import DraftOutput
from tests.support.pair import one_torch_thread  # noqa: F401 (fixture)

K, BATCH, CTX = 3, 2, 48
MAX_LEN = CTX + 60 * (K + 1) + 64


def _engine(outcomes: int) -> DraftEngine:
    head = random_head(TINY, torch.device("cpu"), torch.float32)
    return DraftEngine(head, TINY, EngineConfig(
        method="eagle3", num_speculative_tokens=K, max_model_len=MAX_LEN, max_num_seqs=BATCH,
        max_num_batched_tokens=BATCH * (K + 1), kv_groups=(KVGroupSpec(16, BATCH * -(-MAX_LEN // 16) + 1),),
        dtype="float32", attention_backend="reference", predraft_outcomes=outcomes))


class MemoryClient:
    """What the bench's ZMQ client does, in memory: each call is drafted by the engine, then the
    real PreDraftService pre-drafts and 'pushes'; pushes reach on_push when the target polls
    (late=True: only after the target has picked, i.e. always too late)."""

    def __init__(self, engine: DraftEngine, late: bool = False):
        self.engine, self.late = engine, late
        self.service = PreDraftService(engine)
        self.session = SimpleNamespace(id="s", bases=(0,), block_sizes=(16,), num_speculative_tokens=K)
        self.on_push = None
        self.queue: list = []
        self.sent: list = []  # (request, whether it went without waiting)

    def _serve(self, request) -> torch.Tensor:
        inp = request.inputs
        out = self.engine.propose(**{n: getattr(inp, n) for n in inp.__dataclass_fields__ if
                                     getattr(inp, n) is not None})  # validated, as a server does
        item = SimpleNamespace(call=request, session=self.session, push=self.queue.append)
        self.service.after_batch([item], [out])
        return out.draft_token_ids

    def poll_pushes(self, timeout: float = 0.0, until=None) -> None:
        if not self.late or timeout > 0:  # late: a set comes only to a target that waits past its pick
            self.flush()

    def flush(self) -> None:
        for pre in self.queue:
            self.on_push(pre)
        self.queue.clear()

    def request_drafts(self, request) -> DraftOutput:
        if self.late:
            self.flush()  # the previous call's push, read inside this round trip: after this call's pick
        drafts = self._serve(request)
        self.sent.append((request, False))
        return DraftOutput(drafts, None, BATCH, BATCH * (K + 1))

    def send_nowait(self, request) -> bool:
        self._serve(request)
        self.sent.append((request, True))
        return True

    def detach(self) -> None:
        pass


def _rows(seed: int = 3) -> Rows:
    return Rows(SimConfig(BATCH, K, CTX, MAX_LEN, TINY.vocab_size, TINY.hidden_input_width, seed=seed),
                torch.device("cpu"), torch.float32, Assumptions())


def test_predraft_scale_gives_the_factor():
    a = Assumptions(acceptance=(0.8, 0.7), predraft_factor=0.9)
    assert a.tau(3) == pytest.approx(1 + 0.8 + 0.8 * 0.7 + 0.8 * 0.7 * 0.7)
    for k in (1, 3, 6):
        assert a.tau(k, a.predraft_scale(k)) == pytest.approx(0.9 * a.tau(k), rel=1e-6)
    assert a.hit(3, 3) == a.hit_all and a.hit(5, 6) == a.hit_by_a[-1]


def test_pushed_predrafts_are_picked_and_calls_read_right():
    client = MemoryClient(_engine(4))
    seen = []  # the drafter's count of hits, from the calls alone
    client.service.on_record = lambda rows, hits, outcomes: seen.append(sum(hits.values()))
    drafter = PreDraft(client)
    rows = _rows()
    r = run(rows, drafter, Verify(torch.device("cpu"), 0.0), steps=30, warmup=0)
    print(f"\n[predraft target] hit {r['hit_rate']:.2f} by a {r['hits_by_a']}, unawaited {r['unawaited']}, "
          f"remapped {r['remapped']}, {r['tokens_per_step']:.2f} tokens per step")
    assert r["not_arrived"] == 0 and r["sets"] >= 30 and r["late_sets"] == 0
    # hits are drawn at 0.5-0.94 by a: well above none, below all
    assert 0.4 < r["hit_rate"] < 1.0 and r["unawaited"] > 0
    # the drafter read every call's outcome as the target built it, and both ends agree on the drafts used
    assert sum(seen) == sum(drafter.picker.stats.hits.values()) > 0
    for request, nowait in client.sent[1:]:
        outcomes = outcomes_of_call(request.inputs, request.accepted_counts)
        assert all(o is not None and 0 <= o.accepted <= K for o in outcomes)
    assert sum(nowait for _, nowait in client.sent) == r["unawaited"]


def test_pushes_after_the_pick_are_never_used_and_the_drafter_stops_making_them():
    """Every set comes after verification ended: none is used; the target's b still follows the
    drawn hit rates (it waits for the late set to draw b), so the drafter sees the target verify
    exact drafts where it had counted hits, and its budget falls to 0 (empty sets pushed)."""
    client = MemoryClient(_engine(4), late=True)
    budgets = []
    client.service.on_budget = lambda n, late: budgets.append(n)
    drafter = PreDraft(client)
    r = run(_rows(), drafter, Verify(torch.device("cpu"), 0.0), steps=16, warmup=0)
    print(f"\n[predraft target, late] budgets {budgets}, empty sets {r['empty']}, late {r['late_sets']}")
    assert r["hit_rate"] == 0.0 and r["unawaited"] == 0
    assert r["not_arrived"] == 16 and r["late_sets"] >= 15
    assert budgets[0] == 4 and 0 in budgets and r["empty"] > 0


def test_in_process_and_exact_remote_draw_the_same_outcomes():
    """Same seed, no pre-drafts: the two baselines emit the same tokens (only their timing differs)."""
    engine = _engine(0)
    a = run(_rows(), InProcess(engine), Verify(torch.device("cpu"), 0.0), steps=10, warmup=2)
    b = run(_rows(), ExactRemote(MemoryClient(_engine(0))), Verify(torch.device("cpu"), 0.0), steps=10, warmup=2)
    assert a["tokens_per_step"] == b["tokens_per_step"] and a["tokens_per_step"] > 1.0


def test_no_wait_mode_sends_missed_rows_without_drafts():
    """PreDraftNoWait: a step whose rows mostly hit goes out without waiting, its missed rows
    verifying no drafts; the next call carries those rows as one query token (the drafter reads
    a = 0, nothing verified) and the rows may hit again from an a = 0 outcome."""
    client = MemoryClient(_engine(4))
    drafter = PreDraftNoWait(client)
    r = run(_rows(seed=5), drafter, Verify(torch.device("cpu"), 0.0), steps=30, warmup=0)
    bare = 0
    for request, _ in client.sent[1:]:
        inp = request.inputs
        q = (inp.query_start_loc[1:] - inp.query_start_loc[:-1]).tolist()
        assert set(q) <= {1, K + 1}
        bare += q.count(1)
        outcomes = outcomes_of_call(inp, request.accepted_counts)
        assert all(o is not None for o in outcomes)
        assert all(o.accepted == 0 and o.verified == () for o, n in zip(outcomes, q) if n == 1)
    print(f"\n[predraft target, no wait] hit {r['hit_rate']:.2f}, unawaited {r['unawaited']}, rows without drafts {bare}")
    assert r["unawaited"] > 0 and bare > 0 and r["hit_rate"] > 0.3


def test_stage_breakdown_joins_both_sides_by_call():
    """The per-stage p50s come from the target's stamps of a step, the drafter's marks of the same
    call (by request id) and the next step's verify end; stages that do not apply are left out."""
    from coordinator.bench.predraft_target import server_marks, stage_summary

    us = 1000
    marks = [{"step": 7, "launch": 0, "verify_end": 10_000 * us, "drawn": 10_050 * us, "built": 10_250 * us,
              "sent": 10_260 * us, "drafts": 12_000 * us, "waited": True, "bound": None},
             {"step": 8, "launch": 12_000 * us, "verify_end": 22_000 * us, "drawn": 22_010 * us,
              "built": 22_210 * us, "sent": 22_220 * us, "drafts": 22_300 * us, "waited": False, "bound": None}]
    drafter = {7: {"start": 10_400 * us, "handoff_in": 10_500 * us, "engine": 11_300 * us, "send": 11_350 * us,
                   "predraft_engine_start": 11_400 * us, "predraft_engine": 13_400 * us, "push": 13_500 * us}}
    st = stage_summary(marks, drafter)
    p50 = {name.split()[0]: v["p50_us"] for name, v in st.items()}
    assert p50["A"] == 30 and p50["B"] == 200 and p50["C"] == 10  # medians of (50, 10), (250-50, 210-10), ...
    assert p50["D"] == 140 and p50["E"] == 100 and p50["F"] == 800 and p50["G"] == 50
    assert p50["H"] == 650 and st[next(n for n in st if n.startswith("H"))]["n"] == 1  # waited steps only
    assert p50["J"] == 2000 and p50["K"] == 100
    assert p50["L"] == 22_000 - 13_500  # the push beat the next verify's end by 8.5 ms
    assert p50["Z"] == (2000 + 300) / 2
    assert not any(k.startswith(("M", "N", "O", "P", "Q")) for k in p50)  # no bound stamps


def test_server_marks_reads_the_calls_of_one_run(tmp_path):
    import json

    from coordinator.bench.predraft_target import server_marks

    path = tmp_path / "k3-stages.jsonl"
    lines = [json.dumps({"session": "s", "request_id": rid, "marks": [["start", rid], ["send", rid + 5],
                                                                       ["send", rid + 9]]}) for rid in (4, 5, 6)]
    path.write_text("\n".join(lines) + "\n{\"partial")  # a line still being written is skipped
    got = server_marks(str(path), 5, 6)
    assert sorted(got) == [5, 6] and got[5] == {"start": 5, "send": 10}  # each stage's first mark
    assert server_marks(str(tmp_path / "none.jsonl"), 0, 9) == {}


def test_bound_predraft_stages_join_the_drafters_marks_by_binding_step(tmp_path):
    """A bound pre-draft run's stages: the target's pick-side stamps (BoundPreDrafting.stamps), the
    client's StepDone stamps on waited steps, and the drafter's pre-draft marks (BOUND_MARKS lines)
    joined by the binding's step within the run's window; waited and unawaited steps apart."""
    import json

    from coordinator.bench.predraft_target import bound_marks, per_step, step_values, summarize

    us = 1000
    path = tmp_path / "k3-stages.jsonl"
    lines = [{"session": "s", "request_id": 1, "marks": [["start", 1]]},  # an unbound call's line: skipped here
             {"session": "s", "bound_step": 4, "gpu_us": 2200.0,
              "marks": [["after_reply", 10_400 * us], ["fields", 10_900 * us], ["decided", 11_000 * us],
                        ["queued", 11_100 * us], ["finished", 13_400 * us], ["pushed", 13_500 * us]]},
             {"session": "s", "bound_step": 5, "gpu_us": None, "marks": [["after_reply", 22_500 * us],
                                                                         ["pushed", 22_600 * us]]},
             {"session": "old", "bound_step": 4, "gpu_us": 1.0, "marks": [["after_reply", 1 * us]]}]  # another run
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    got = bound_marks(str(path), 5_000 * us, 30_000 * us)
    assert sorted(got) == [4, 5] and got[4]["gpu_us"] == 2200.0 and got[4]["queued"] == 11_100 * us
    marks = [{"step": 7, "bstep": 4, "launch": 0, "verify_end": 10_000 * us, "drawn": 10_050 * us,
              "built": 10_250 * us, "sent": 10_260 * us, "drafts": 12_000 * us, "waited": True,
              "bound": {"sent": 10_600 * us, "received": 10_650 * us, "started": 10_660 * us, "queued": 10_700 * us,
                        "replied": 10_710 * us, "answered": 10_800 * us, "read": 11_900 * us},
              "pd": {"polled": 10_300 * us, "picked": 10_310 * us, "settled": 10_320 * us, "filled": 10_590 * us}},
             {"step": 8, "bstep": 5, "launch": 12_000 * us, "verify_end": 22_000 * us, "drawn": 22_010 * us,
              "built": 22_210 * us, "sent": 22_220 * us, "drafts": 22_400 * us, "waited": False, "bound": {},
              "pd": {"polled": 22_230 * us, "picked": 22_240 * us, "settled": 22_300 * us, "filled": 22_350 * us,
                     "sent": 22_390 * us}}]
    steps = step_values(marks, {}, got)
    waited = {name.split()[0]: v["p50_us"] for name, v in summarize([x for x in steps if x["waited"]]).items()}
    unawaited = {name.split()[0]: v["p50_us"] for name, v in summarize([x for x in steps if not x["waited"]]).items()}
    assert waited["Q1"] == 90 and waited["Q2"] == 1100 and waited["Q"] == 1190
    assert waited["S"] == 50 and waited["T"] == 10 and waited["U"] == 270 and "V2" not in waited
    assert waited["W1"] == 500 and waited["W3"] == 100 and waited["W4"] == 2300 and waited["WG"] == 2200
    assert waited["X2"] == 800  # the drafts reached the target's host 0.8 ms after the pre-draft was queued
    assert waited["L3"] == 22_000 - 13_500
    assert unawaited["T"] == 60 and unawaited["V2"] == 40 and unawaited["Z"] == 400
    assert not any(k.startswith(("Q", "W1", "X2")) for k in unawaited)  # no StepDone stamps, no drafter fields mark
    rows = per_step(steps)
    assert rows[0]["waited"] and rows[0]["Q2"] == 1100 and not rows[1]["waited"] and rows[1]["V2"] == 40


def test_reachable_bound_by_round_trip_rule():
    """coordinator.bench.predraft_target.reachable: batch 1, every step a hit or a miss; all rows
    hitting (h^b) and the best no-wait threshold; perfect prediction caps both."""
    from coordinator.bench.predraft_target import reachable

    one = reachable(10.0, 1, 2.0, 3.0, 0.5, 4.0)
    assert abs(one["all_hit"] - 1e3 * (0.5 * 4.0 + 0.5 * 3.0) / (0.5 * 10.0 + 0.5 * 12.0)) < 1e-9
    assert one["no_wait"] == one["all_hit"] and one["threshold"] == 1 and one["perfect"] == 400.0
    two = reachable(10.0, 2, 2.0, 3.0, 0.5, 4.0)
    # all rows hit: 1/4 of steps at 8 tokens in 10 ms, else 6 tokens in 12 ms
    assert abs(two["all_hit"] - 1e3 * (0.25 * 8 + 0.75 * 6) / (0.25 * 10 + 0.75 * 12)) < 1e-9
    # one hit of two enough: a missed row verifies nothing (1 token)
    at_one = 1e3 * (0.25 * 8 + 0.5 * 5 + 0.25 * 6) / (0.75 * 10 + 0.25 * 12)
    assert abs(two["no_wait"] - max(at_one, two["all_hit"])) < 1e-9
    assert reachable(10.0, 4, 2.0, 3.0, 1.0, 4.0)["all_hit"] == reachable(10.0, 4, 2.0, 3.0, 1.0, 4.0)["perfect"]


def test_server_plan_and_deeper_table():
    """--predraft-ks: a server per k' > k for the pre-draft modes (exact modes on the plain one), and
    the depth table sets each pre-draft run beside in-process at its best k and the reachable bound."""
    from coordinator.bench.predraft_target import deeper_table, runs_at, server_plan

    modes = ["in_process", "exact_bound", "predraft_bound"]
    plan = server_plan([3], [3, 6], modes)
    assert plan == [(3, 3), (3, 6)] and server_plan([3], [6], ["in_process", "predraft_bound"]) == [(3, 6)]
    assert runs_at(3, modes, plan) == [("in_process", 3), ("exact_bound", 3), ("predraft_bound", 3),
                                       ("predraft_bound", 6)]
    assert runs_at(6, modes, plan) == [("in_process", 6)]
    base = dict(verify_ms=10.0, batch=1, steps=30)
    results = [dict(base, mode="in_process", k=3, tokens_per_s=270.0, tokens_per_step=3.0, step_ms_mean=11.0),
               dict(base, mode="in_process", k=6, tokens_per_s=340.0, tokens_per_step=4.0, step_ms_mean=11.8),
               dict(base, mode="predraft_bound", k=3, predraft_k=6, tokens_per_s=300.0, hit_rate=0.75,
                    hits_by_a={0: 0.5, 3: 0.9}, tokens_per_predrafted_row=3.7, unawaited=20)]
    lines = deeper_table(results, Assumptions(), [10.0], [1])
    assert len(lines) == 3
    assert "| 340 (6) | predraft_bound, 3 -> 6 | 300 | 0.75 | 0.50/0.90 | 3.70 | 20/30 |" in lines[2]
    row = [c.strip() for c in lines[2].split("|")]
    assert row[11] == f"{300 / 270:.3f}" and row[12] == f"{300 / 340:.3f}"
    from coordinator.bench.predraft_target import reachable

    got = reachable(10.0, 1, 1.0, 3.0, 0.75, 3.7)
    assert row[13] == f"{got['all_hit'] / 340:.3f}" and row[15] == f"{got['perfect'] / 340:.3f}"


def test_a_call_after_a_deeper_hit_may_report_k_prime_accepted():
    """The unbound check (drafter.service.sessions.check_call): accepted counts up to k' where the
    drafter pre-drafts k' > k (EngineDescription.predraft_tokens), up to k otherwise."""
    from dataclasses import replace

    from drafter.service.sessions import SessionTable, check_call
    from drafter.wire.errors import DrafterError
    from tests.unit.test_service_sessions import ENG, _call, layout

    for eng, ok in ((ENG, False), (replace(ENG, predraft_tokens=5), True)):
        s = SessionTable(eng, max_sessions=4).attach(layout())
        check_call(s, _call(accepted_counts=torch.tensor([3])), eng)
        if ok:
            check_call(s, _call(accepted_counts=torch.tensor([5])), eng)
        else:
            with pytest.raises(DrafterError) as e:
                check_call(s, _call(accepted_counts=torch.tensor([5])), eng)
            assert e.value.field == "accepted_counts"
        with pytest.raises(DrafterError):
            check_call(s, _call(accepted_counts=torch.tensor([6])), eng)
