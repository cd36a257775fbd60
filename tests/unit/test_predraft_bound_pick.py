"""coordinator.predraft.BoundPreDrafting's pick and send policy, without a drafter: a set pushed
for the previous step; every row a hit goes without waiting (step_nowait) with the pre-drafts; a
miss waits for the exact step and verifies its exact drafts in every row; with min_hits, a step whose share
of hits is enough goes without waiting and its missed rows verify no drafts (-1)."""

from __future__ import annotations

import torch

from coordinator.bench.predraft_target import Assumptions, Rows, SimConfig
from coordinator.predraft import BoundPreDrafting
from drafter.wire.predraft import PreDrafts, verifies_predrafts
from drafter.wire.records import ProposeInputs

K, B = 3, 2


class FakeClient:
    """The CudaIpcBoundClient surface BoundPreDrafting uses; the exact drafts are all 7s."""

    width = K
    predraft_min_hits = 0.0

    def __init__(self):
        self.link, self.last_step, self.on_push = object(), 0, None
        self.views = {name: torch.zeros(64, dtype=torch.int64) for name in
                      ("target_token_ids", "target_positions", "next_token_ids", "query_start_loc", "seq_lens",
                       "num_rejected_tokens", "token_indices_to_sample", "slot_mappings[0]")}
        self.views["target_hidden_states"] = torch.zeros(64, 4)
        self.views["block_tables[0]"] = torch.zeros(B, 6, dtype=torch.int64)  # max_len 96 / 16
        self.sent: list[str] = []

    def poll_pushes(self, timeout_s=0.0, until=None):
        pass

    def settle(self):
        self.sent.append("settle")

    def step_nowait(self, n, b, *args):
        self.last_step += 1
        self.sent.append("nowait")

    def step(self, n, b, *args, **kw):
        self.last_step += 1
        self.sent.append("step")
        return torch.full((b, K), 7, dtype=torch.long)


def _setup(min_hits=None):
    rows = Rows(SimConfig(B, K, ctx=20, max_len=96, vocab=100, width=4), torch.device("cpu"), torch.float32,
                Assumptions())
    client = FakeClient()
    pd = BoundPreDrafting(client, min_hits=min_hits)
    kw, _ = rows.call(None, rows._tokens(B), rows.hidden)  # the first step: exact
    pd.step(ProposeInputs(**{f: kw.get(f) for f in ProposeInputs.__dataclass_fields__}), None)
    # the set pushed for step 1: per row outcome (3, 11) and (0, 12), drafts 100 + row
    pre = PreDrafts(1, rows.tables[:, 0].long(), rows.p.clone(), torch.full((B, K), 7, dtype=torch.long),
                    accepted=torch.tensor([[3, 0]] * B), next_tokens=torch.tensor([[11, 12]] * B),
                    drafts=torch.stack([torch.full((2, K), 100 + r) for r in range(B)]))
    rows.set_drafts(torch.full((B, K), 7, dtype=torch.long), [False] * B)
    assert client.on_push(pre)
    return rows, client, pd


def _next(rows, pd, accepted, tokens):
    kw, counts = rows.call(accepted, torch.tensor(tokens), rows.hidden)
    return pd.step(ProposeInputs(**{f: kw.get(f) for f in ProposeInputs.__dataclass_fields__}), counts)


def test_every_row_a_hit_goes_without_waiting():
    rows, client, pd = _setup()
    drafts, pre = _next(rows, pd, [3, 0], [11, 12])
    assert pre == [True, True] and client.sent[-1] == "nowait" and pd.unawaited == 1
    assert drafts.tolist() == [[100] * K, [101] * K]


def test_a_miss_waits_and_verifies_the_exact_drafts_in_every_row():
    rows, client, pd = _setup()
    drafts, pre = _next(rows, pd, [3, 0], [11, 13])  # row 1's (0, 13) was not predicted
    assert pre == [False, False] and client.sent[-1] == "step" and pd.unawaited == 0
    assert drafts.tolist() == [[7] * K, [7] * K], "waited anyway: the exact drafts (the drafter assumes so too)"
    assert pd.picker.stats.hits == {3: 1}, "the hit still counts as one"


def test_min_hits_sends_a_mostly_hit_step_and_its_missed_rows_verify_none():
    rows, client, pd = _setup(min_hits=0.5)
    drafts, pre = _next(rows, pd, [3, 0], [11, 13])
    assert pre == [True, False] and client.sent[-1] == "nowait" and pd.unawaited == 1
    assert drafts.tolist() == [[100] * K, [-1] * K]
    assert client.sent[-2] == "settle", "the views are written after settle()"
    assert client.predraft_min_hits == 0.5, "the rule goes to the drafter in the step's header"


def test_deeper_predrafts_go_out_whole_and_the_next_step_carries_them():
    """k' = 5 > k = 3: every row a hit sends the step without waiting with all 5 drafts of each
    pre-draft; the target verifies them, so the next call has k' + 1 query tokens in those rows."""
    kp = 5
    rows = Rows(SimConfig(B, K, ctx=20, max_len=96, vocab=100, width=4, predraft_k=kp), torch.device("cpu"),
                torch.float32, Assumptions())
    client = FakeClient()
    pd = BoundPreDrafting(client)
    kw, _ = rows.call(None, rows._tokens(B), rows.hidden)
    pd.step(ProposeInputs(**{f: kw.get(f) for f in ProposeInputs.__dataclass_fields__}), None)
    cond = torch.full((B, kp), -1, dtype=torch.long)
    cond[:, :K] = 7
    pre = PreDrafts(1, rows.tables[:, 0].long(), rows.p.clone(), cond, accepted=torch.tensor([[3, 0]] * B),
                    next_tokens=torch.tensor([[11, 12]] * B),
                    drafts=torch.stack([torch.arange(kp).repeat(2, 1) + 100 * (r + 1) for r in range(B)]))
    rows.set_drafts(torch.full((B, K), 7, dtype=torch.long), [False] * B)
    assert rows.ndraft.tolist() == [K] * B and rows.drafts[:, K:].eq(-1).all(), "exact rows verify k"
    assert client.on_push(pre)
    drafts, got = _next(rows, pd, [3, 0], [11, 12])
    assert got == [True, True] and client.sent[-1] == "nowait"
    assert drafts.tolist() == [[100, 101, 102, 103, 104], [200, 201, 202, 203, 204]]
    rows.set_drafts(drafts, got)
    assert rows.ndraft.tolist() == [kp] * B
    kw, counts = rows.call([kp, 2], torch.tensor([5, 6]), rows.hidden)
    assert kw["query_start_loc"].tolist() == [0, kp + 1, 2 * (kp + 1)]
    assert kw["target_token_ids"][1:kp + 1].tolist() == [100, 101, 102, 103, 104]
    assert kw["num_rejected_tokens"].tolist() == [0, kp - 2] and counts.tolist() == [kp, 2]


def test_both_ends_rule():
    hit, miss = torch.zeros(K), None
    assert verifies_predrafts([hit, hit]) and not verifies_predrafts([hit, miss]) and not verifies_predrafts([])
    assert verifies_predrafts([hit, miss], 0.5) and not verifies_predrafts([hit, miss, miss], 0.5)
    assert not verifies_predrafts([miss, miss], 0.5) and not verifies_predrafts([miss], 0.01)


# ------------------------------------------------------------------ the drafter's side yields to waiting steps
def test_bound_steps_waiting_for_the_engine_are_counted():
    import threading
    import time
    from types import SimpleNamespace

    from drafter.service.bound_ipc import on_engine, steps_waiting

    lock = threading.Lock()
    session = SimpleNamespace(core=SimpleNamespace(executor=SimpleNamespace(engine_lock=lock)),
                              device=torch.device("cpu"))
    lock.acquire()  # a batch or a pre-draft holds the engine
    got = []
    t = threading.Thread(target=lambda: got.append(on_engine(session, lambda: steps_waiting())))
    t.start()
    deadline = time.monotonic() + 30
    while steps_waiting() != 1 and time.monotonic() < deadline:  # the step blocks on the lock
        pass
    assert steps_waiting() == 1
    lock.release()
    t.join(30)
    assert got == [0] and steps_waiting() == 0, "counted while waiting only"
    assert on_engine(session, lambda: steps_waiting(), step=False) == 0


def test_a_bound_predraft_yields_to_a_waiting_step():
    from types import SimpleNamespace

    from drafter.service.predraft import BoundPreDrafts, PreDraftService
    from drafter.wire import bound as wb
    from drafter.wire.predraft import bound_push_from_frame

    engine = SimpleNamespace(config=SimpleNamespace(predraft_outcomes=4, num_speculative_tokens=K),
                             predraft=lambda *a, **kw: None)
    service = PreDraftService(engine)
    skipped = []
    service.on_skip = lambda: skipped.append(1)
    session = SimpleNamespace(id="s", num_blocks=(16,), bases=(0,))
    pre = BoundPreDrafts(service, engine, session, {wb.HIDDEN: torch.zeros(8, 4)}, {},
                         torch.zeros(B, K, dtype=torch.long), torch.device("cpu"), epoch=1, waiting=lambda: 1)
    pre.pending = wb.StepHeader(step=5, num_tokens=B, batch=B, want_predrafts=True)
    frames = []
    pre.after_reply(frames.append, lambda fn, *a: fn(*a))
    got, session_id, epoch = bound_push_from_frame(frames[0])
    assert (got.step, session_id, epoch) == (5, "s", 1) and not bool((got.accepted >= 0).any()), "an empty set"
    assert skipped == [1] and service.budgets["s"].outcomes == 2, "skipped: the budget halved"


def test_a_bound_predraft_waits_for_its_own_taken_only():
    """BoundPreDrafts._await_taken: older TAKENs are noted and passed over until the step's own; a frame
    that is not a TAKEN ends the wait and is handed back to the channel's loop; none in time (the
    target stopped sending them) ends it and the binding stops waiting until a TAKEN comes again."""
    from types import SimpleNamespace

    from drafter.service.predraft import BoundPreDrafts, PreDraftService
    from drafter.wire import bound as wb
    from drafter.wire import doorbell
    from drafter.wire.predraft import taken_frame

    engine = SimpleNamespace(config=SimpleNamespace(predraft_outcomes=4, num_speculative_tokens=K))
    session = SimpleNamespace(id="s", num_blocks=(16,), bases=(0,))
    pre = BoundPreDrafts(PreDraftService(engine), engine, session, {wb.HIDDEN: torch.zeros(8, 4)}, {},
                         torch.zeros(B, K, dtype=torch.long), torch.device("cpu"), epoch=1)
    assert not pre.taken_seen and not pre.note_taken(doorbell.WAKE)

    def frames(*fs):
        queue = list(fs)
        return lambda seconds: queue.pop(0) if queue else None

    assert pre.note_taken(taken_frame(2)) and pre.taken_seen and pre.taken_step == 2
    pre._await_taken(5, frames(taken_frame(3), taken_frame(5), b"never read"))
    assert pre.taken_step == 5 and pre._caught is None and pre.taken_seen
    header = wb.encode(wb.StepHeader(step=7, num_tokens=B, batch=B))
    pre._await_taken(6, frames(header))
    assert pre._caught == header and pre.taken_step == 5, "the next header goes back to the loop"
    pre._caught = None
    pre._await_taken(6, frames())
    assert not pre.taken_seen, "no TAKEN in time: this binding's pre-drafts stop waiting"
