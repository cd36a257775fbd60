"""Pre-drafts pushed on a bound session (issue 23): the cuda_ipc plane on CPU (cuda_slab.LocalSlabs,
as tests/integration/test_bound_ipc.py), a drafter with --predraft-outcomes, the target's side
coordinator.predraft.BoundPreDrafting over CudaIpcBoundClient.

The target is the bench's simulated one (coordinator.bench.predraft_target.Rows): each step it
draws the outcome the test asks for (one the pushed set predicted: a hit, or one it did not: a
miss) and builds the next padded-batch call.  An in-process engine replays every call and
pre-drafts offline for the drafts the target verified.  Each pushed set must equal that offline
pre-draft; on a step whose rows all hit the target must verify exactly the offline pre-drafts for
their outcomes, with no round trip (the step goes out unawaited); on a miss the exact drafts; a set that arrives after
the target picked for the next step must be dropped."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_bound_remote import (MAX_BATCH, PADDING, SESSION_BLOCKS, Drafter,  # noqa: E402
                                                 _buffers)

from coordinator.bench.predraft_target import Assumptions, PreDraftBound, Rows, SimConfig, Verify, run  # noqa: E402
from coordinator.predraft import BoundPreDrafting, call_inputs  # noqa: E402
from coordinator.transport.bound_ipc import CudaIpcBoundClient  # noqa: E402
from drafter.engine.graphs import GraphRunner  # noqa: E402
from drafter.service import bound_ipc  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from drafter.wire.cuda_slab import LocalSlabs  # noqa: E402
from drafter.wire.predraft import lookup, merge, outcomes_of_call, verifies_predrafts  # noqa: E402
from drafter.wire.records import ProposeInputs  # noqa: E402
from tests.support.engines import build_engine  # noqa: E402
from tests.support.servers import layout_for  # noqa: E402

K, OUTCOMES, BATCH, MAX_LEN, MAX_TOKENS = 3, 2, 2, 96, 32
KP = 5  # pre-drafts deeper than k: an all-hit step verifies 5 drafts a row (12 tokens in the next step)


@pytest.fixture(autouse=True)
def _local_slabs(monkeypatch):
    monkeypatch.setattr(bound_ipc, "BACKEND", LocalSlabs())


@pytest.fixture(scope="module")
def engines(tiny_root):
    """(the served engine with emulated graphs, the in-process reference), built once for the module,
    pre-drafting k' = KP > k (--predraft-k; k' = k is the same code at one width, which the lossless
    bound test runs)."""
    return _engines(tiny_root, KP)


def _engines(root, predraft_tokens: int = 0):
    kw = dict(k=K, max_model_len=MAX_LEN, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_TOKENS,
              num_blocks=2 * SESSION_BLOCKS, predraft_outcomes=OUTCOMES, capture_sizes=(MAX_BATCH,),
              predraft_tokens=predraft_tokens)
    served = build_engine(root, "eagle3", attention_backend="triton", device="cpu", skinny_gemm="off", **kw)
    served.graphs = GraphRunner(served, emulate=True, combined=False)
    served.graphs.token_sizes, served.graphs.batch_sizes = [PADDING["tokens_padded"]], [MAX_BATCH]
    served.graphs.capture()
    return served, build_engine(root, "eagle3", **kw)


def _call(kw: dict) -> ProposeInputs:
    return ProposeInputs(**{f: kw.get(f) for f in ProposeInputs.__dataclass_fields__})


def _client(drafter, served) -> CudaIpcBoundClient:
    layout = layout_for(drafter.core.info(), SESSION_BLOCKS, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_TOKENS)
    return CudaIpcBoundClient(drafter.endpoint, layout, _buffers(served), max_batch=MAX_BATCH, device="cpu",
                              timeout_s=120, allow_fallback=False, slabs=LocalSlabs())


class Offline:
    """The in-process engine: every call replayed, pre-drafts made offline for the drafts verified."""

    def __init__(self, engine):
        self.engine, self.sets = engine, {}

    def step(self, step: int, kw: dict, counts, outcomes: int | None) -> torch.Tensor:  # [b, k or k'] used drafts
        exact = self.engine.propose(**kw).draft_token_ids
        inp = call_inputs(kw)
        hits = [lookup(self.sets.get(step - 1), o) for o in outcomes_of_call(inp, counts)]
        if not verifies_predrafts(hits):  # the target waits: the exact drafts in every row
            hits = [None] * len(hits)
        used, _ = merge(exact, hits)
        if outcomes:
            self.sets[step] = self.engine.predraft(inp, used, step, outcomes=outcomes)
        return used


def _draw(rows: Rows, pre, hit: list[bool]) -> tuple[list[int], torch.Tensor]:
    """Per row: a predicted outcome of `pre` (hit), else a = 0 and a b no outcome with a = 0 predicted."""
    accepted, tokens = [], torch.zeros(rows.cfg.batch, dtype=torch.long)
    for r in range(rows.cfg.batch):
        row = pre.row_of(int(rows.tables[r, 0]), int(rows.p[r]))
        assert row is not None, "the pushed set covers every row"
        if hit[r]:
            accepted.append(int(pre.accepted[row, 0]))
            tokens[r] = pre.next_tokens[row, 0]
            continue
        taken = {int(pre.next_tokens[row, i]) for i in range(pre.num_outcomes) if int(pre.accepted[row, i]) == 0}
        b = 0
        while b in taken:
            b += 1
        accepted.append(0)
        tokens[r] = b
    return accepted, tokens


def test_bound_pushes_equal_offline_predrafts_and_hits_cost_no_round_trip(engines):
    """At k' = 5 > k = 3 (the k' = k path is the same code at one width; the lossless bound test runs
    it): pushed sets equal the offline pre-drafts, an all-hit step verifies all 5 drafts of each
    pre-draft unawaited, and the next step (6 query tokens in those rows, up to 5 accepted) passes
    the drafter's guard and is pre-drafted from exactly as offline."""
    served, reference = engines
    with Drafter(served) as drafter:
        client = _client(drafter, served)
        pd = BoundPreDrafting(client, push_wait_s=120)  # the test waits for each set: every pick can hit
        pushed = {}
        offer = pd.picker.offer
        client.on_push = lambda pre: (pushed.__setitem__(pre.step, pre), offer(pre))[1]
        offline = Offline(reference)
        rows = Rows(SimConfig(BATCH, K, ctx=8, max_len=MAX_LEN, vocab=drafter.core.desc.vocab_size,
                              width=served.spec.hidden_input_width, predraft_k=KP), torch.device("cpu"), torch.float32,
                    Assumptions())
        assert drafter.core.info().predraft_tokens == KP
        # per step after the first: which rows' outcomes the pushed set predicted
        plan = [[True, True], [True, True], [False, True], [True, True]]
        try:
            kw, counts = rows.call(None, rows._tokens(BATCH), rows.hidden)
            drafts, pre_rows = pd.step(_call(kw), None, **PADDING)
            assert client.plane == wb.CUDA_IPC
            assert torch.equal(drafts, offline.step(1, kw, None, OUTCOMES)), "the first step's exact drafts"
            rows.set_drafts(drafts, pre_rows)
            for step, hit in enumerate(plan, start=2):
                client.poll_pushes(60, until=lambda s=step: (s - 1) in pushed)
                got = pushed[step - 1]
                want = offline.sets[step - 1]
                assert torch.equal(got.block_ids, want.block_ids) and torch.equal(got.positions, want.positions)
                assert torch.equal(got.conditioned_on, want.conditioned_on)
                n = got.num_outcomes
                assert torch.equal(got.accepted, want.accepted[:, :n]), "the outcomes the engine ranks"
                assert torch.equal(got.next_tokens, want.next_tokens[:, :n])
                assert torch.equal(got.drafts, want.drafts[:, :n]), "pushed drafts equal the offline pre-drafts"
                accepted, tokens = _draw(rows, got, hit)
                kw, counts = rows.call(accepted, tokens, rows.hidden)
                unawaited = pd.unawaited
                drafts, pre_rows = pd.step(_call(kw), counts, **PADDING)
                used = offline.step(step, kw, counts, n)
                assert pre_rows == (hit if all(hit) else [False] * BATCH), (step, pre_rows)
                assert torch.equal(drafts, used), f"step {step}: the drafts verified are the offline ones"
                assert drafts.shape[1] == (KP if all(hit) else K), "a hit step verifies the pre-drafts whole"
                assert pd.unawaited == unawaited + all(hit), "all rows hit: sent without waiting, else waited"
                rows.set_drafts(drafts, pre_rows)
            assert pd.picker.stats.hit_rate > 0.8 and pd.picker.stats.late == 0
            # a set that reaches the target after it picked for the next step is dropped, never used
            last = client.last_step
            kw, counts = rows.call([0] * BATCH, rows._tokens(BATCH), rows.hidden)
            pd.picker.pick(last + 1, _call(kw), counts)  # the target picked before the push was read
            client.poll_pushes(120, until=lambda: pd.picker.stats.late > 0)
            assert pd.picker.stats.late == 1 and not pd.picker.has(last), "the late set was dropped"
            session = drafter.server._bound_plane.sessions[client.session.session_id]
            assert session._predrafts is not None
        finally:
            client.close()


def test_the_benchs_bound_predraft_mode_runs_its_loop(engines):
    """coordinator.bench.predraft_target's predraft_bound mode (its GPU record's code path) over the
    same plane: every step's set is pushed and read (on this CPU each comes after the simulated
    1 ms verify, so the bench counts it late and the step waits: never used for a later step)."""
    import drafter.service.predraft as service_predraft

    served, _ = engines
    import threading

    seen, marked = {}, threading.Condition()  # binding step -> the drafter's pre-draft marks (BOUND_MARKS)

    def hook(session, step, marks, gpu_us):
        with marked:
            seen[step] = marks
            marked.notify_all()
    service_predraft.BOUND_MARKS = hook
    with Drafter(served) as drafter:
        client = _client(drafter, served)
        mode = PreDraftBound(client)
        rows = Rows(SimConfig(BATCH, K, ctx=8, max_len=MAX_LEN, vocab=drafter.core.desc.vocab_size,
                              width=served.spec.hidden_input_width, seed=3, predraft_k=KP), torch.device("cpu"),
                    torch.float32, Assumptions())
        try:
            out = run(rows, mode, Verify(torch.device("cpu"), 1.0), steps=1, warmup=0)
            assert client.plane == wb.CUDA_IPC
            assert out["steps"] == 1 and out["tokens_per_step"] >= 1.0
            assert out["sets"] + out["late_sets"] >= 1, out  # the timed step found the previous step's set
            assert out["unawaited"] == sum(not m["waited"] for m in out["marks"])
            m = out["marks"][0]  # the pick side's stamps, in order, and the binding's step
            assert m["pd"]["polled"] <= m["pd"]["picked"] <= m["pd"]["settled"] <= m["pd"]["filled"] <= m["drafts"]
            assert m["bstep"] == client.last_step
            with marked:  # the hook runs after each push: the timed step's pre-draft is the last
                assert marked.wait_for(lambda: m["bstep"] in seen, timeout=120)
            for step in (1, m["bstep"]):  # every pre-draft's marks reached the hook, in order
                names = [name for name, _ in seen[step]]
                assert names[0] == "after_reply" and names[-1] == "pushed", names
                assert names in (["after_reply", "pushed"],  # none made (a skip, budget 0)
                                 ["after_reply", "fields", "decided", "queued", "finished", "pushed"],
                                 ["after_reply", "fields", "decided", "taken", "queued", "finished", "pushed"]), names
                assert [ns for _, ns in seen[step]] == sorted(ns for _, ns in seen[step])
        finally:
            service_predraft.BOUND_MARKS = None
            mode.close()


def test_an_awaited_steps_predraft_waits_for_the_targets_taken(engines):
    """Issue 23: the drafter's pre-draft after an awaited step queues its GPU work only once the target
    holds that step's drafts (its TAKEN on the doorbell), never while the target still reads them;
    an unawaited step's starts at once and no TAKEN is sent for it.  The drafter learns that the
    target sends them from the first one (step 1's, read as a stray frame)."""
    import threading

    import drafter.service.predraft as service_predraft

    served, _ = engines
    seen, marked = {}, threading.Condition()

    def hook(session, step, marks, gpu_us):
        with marked:
            seen[step] = dict(marks)
            marked.notify_all()
    service_predraft.BOUND_MARKS = hook
    with Drafter(served) as drafter:
        client = _client(drafter, served)
        pd = BoundPreDrafting(client, push_wait_s=120)
        pushed = {}
        offer = pd.picker.offer
        client.on_push = lambda pre: (pushed.__setitem__(pre.step, pre), offer(pre))[1]
        rows = Rows(SimConfig(BATCH, K, ctx=8, max_len=MAX_LEN, vocab=drafter.core.desc.vocab_size,
                              width=served.spec.hidden_input_width, seed=5, predraft_k=KP), torch.device("cpu"),
                    torch.float32, Assumptions())
        try:
            kw, _ = rows.call(None, rows._tokens(BATCH), rows.hidden)
            drafts, pre_rows = pd.step(_call(kw), None, **PADDING)
            assert client.link.bell is not None, "the doorbell carries the steps (and the TAKEN words)"
            assert "taken" in pd.stamps, "step 1 waited: its TAKEN went out"
            rows.set_drafts(drafts, pre_rows)
            stamps = {}
            for step, hit in enumerate([[False, True], [True, True], [True, False]], start=2):
                client.poll_pushes(60, until=lambda s=step: (s - 1) in pushed)
                kw, counts = rows.call(*_draw(rows, pushed[step - 1], hit), rows.hidden)
                drafts, pre_rows = pd.step(_call(kw), counts, **PADDING)
                stamps[step] = dict(pd.stamps)
                rows.set_drafts(drafts, pre_rows)
            client.poll_pushes(60, until=lambda: 4 in pushed)
            with marked:
                assert marked.wait_for(lambda: {1, 2, 3, 4} <= set(seen), timeout=120)
            session = drafter.server._bound_plane.sessions[client.session.session_id]
            assert session._predrafts.taken_seen and session._predrafts.taken_step == 4
        finally:
            service_predraft.BOUND_MARKS = None
            client.close()
    assert "taken" not in seen[1], "before any TAKEN came the drafter did not wait for one"
    for step in (2, 4):  # awaited (a row missed): the pre-draft's GPU work after the target's TAKEN
        m = seen[step]
        assert "taken" in stamps[step] and "taken" in m, (step, m)
        assert m["decided"] <= m["taken"] <= m["queued"], m
        assert stamps[step]["taken"] <= m["queued"], "the pre-draft was queued only after the target's TAKEN"
    assert "taken" not in stamps[3] and "taken" not in seen[3], "an unawaited step: no TAKEN, no wait"
