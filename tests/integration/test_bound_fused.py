"""Several bindings' bound steps fused into one engine call (drafter.service.batching.bound_steps).

A drafter in this process (tests.integration.test_bound_remote's Drafter: a real ZMQ server on
loopback, emulated graphs, the Triton kernels under the interpreter on CPU) serves several bound
clients.  The overlap is made deterministic: the test holds the engine's lock while the clients'
steps arrive and waits until the drafter has them all pending (BoundSteps.wait_pending), then lets
the engine go; whoever takes it serves them all.  Fused drafts must equal the in-process engine's
and the same session's drafts served alone; the fused counters must move (so the test fails if
fusion never happens); a corrupt step among them is refused naming its field while the others'
drafts are exact and no other session's KV changes.

Every step is padded to (16 tokens, batch 4), the one size pair captured: the plans below keep
the fused sums inside it (three one-request steps of <= 5 tokens, two two-request steps of <= 8).
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.integration.test_bound_remote import (K, MAX_BATCH, MAX_TOKENS, PADDING, SESSION_BLOCKS,  # noqa: E402
                                                 Drafter, Target, _buffers, _engine, _fill, _scenario)

from coordinator.transport.bound_ipc import CudaIpcBoundClient  # noqa: E402
from drafter.service import bound_ipc  # noqa: E402
from drafter.service.bound_sessions import BoundPlane  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from drafter.wire.cuda_slab import LocalSlabs  # noqa: E402
from drafter.wire.errors import Code, DrafterError  # noqa: E402
from tests.support.servers import layout_for  # noqa: E402

ONE = [[(0, 5, 0)], [(0, K + 1, 1)]]  # a one-request prefill, then a decode step with one token rejected
TWO = [[(0, 4, 0), (1, 3, 0)], [(0, K + 1, 1), (1, K + 1, 0)]]  # the same for two requests
WAIT_S = 120.0  # an emulated step takes seconds under the interpreter; a step's client waits 60


class Step:
    """One target's step prepared on the test's thread: the expected drafts, its call in the client's buffers."""

    def __init__(self, target: Target, plan, corrupt: str | None = None, value: int | None = None):
        """corrupt: the field written out of the session's range (value: the bad block id or slot)."""
        self.target = target
        self.expected = target.ref.propose(**target.s_ref.call(plan).kwargs).draft_token_ids
        self.call = target.s_remote.call(plan).kwargs
        self.n, self.b = _fill(target.client.views, self.call)
        views = target.client.views
        if corrupt == "block_tables[0]":
            views[corrupt][self.b - 1, 0] = value
        elif corrupt == "slot_mappings[0]":
            views[corrupt][self.n - 1] = value
        self.got: torch.Tensor | None = None
        self.error: BaseException | None = None

    def resend(self) -> None:
        """The same step made whole, sent alone: its drafts must be the expected ones."""
        self.n, self.b = _fill(self.target.client.views, self.call)
        self.send()
        assert self.error is None and torch.equal(self.got, self.expected), repr(self.error)

    def send(self) -> None:
        self.got, self.error = None, None
        try:
            self.got = self.target.client.step(self.n, self.b, **PADDING)
        except BaseException as exc:  # noqa: BLE001 - checked by the test's thread
            self.error = exc


def _together(drafter: Drafter, steps: list[Step]) -> None:
    """Every step sent while the test holds the engine's lock; released once the drafter has all of
    them pending, so the first to take the engine serves them together."""
    lock, pending = drafter.core.executor.engine_lock, _steps(drafter)
    threads = [threading.Thread(target=s.send, daemon=True) for s in steps]
    lock.acquire()
    try:
        for t in threads:
            t.start()
        assert pending.wait_pending(len(steps), WAIT_S), f"only {pending.pending()} of {len(steps)} steps came"
    finally:
        lock.release()
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive(), "a step got no answer"


@pytest.fixture
def ipc(tmp_path_factory) -> str:
    """The drafter's ipc endpoint (it listens on ipc too: the ipc transport's data sockets)."""
    return f"ipc://{tmp_path_factory.mktemp('fused')}/drafter.sock"


def _steps(drafter: Drafter):
    """The drafter's BoundSteps (its bound plane made here where no Bind made it yet)."""
    return BoundPlane.of(drafter.server).steps


def _fused(drafter: Drafter) -> tuple[int, int, float]:
    """The drafter's fused (calls, steps) and the metric's steps."""
    steps = _steps(drafter)
    metric = drafter.core.metrics.registry.get_sample_value("drafter_bound_fused_steps_total") or 0.0
    return steps.fused_calls, steps.fused_steps, metric


def _blocks(engine, session: int) -> list[torch.Tensor]:
    """The pool blocks of the session bound `session`-th (every KV layer; the blocks dim: 1 of a 5-D K/V pair)."""
    return [t.narrow(1 if t.dim() == 5 else 0, session * SESSION_BLOCKS, SESSION_BLOCKS).clone()
            for t in engine.kv_snapshot()]


def _targets(root, drafter: Drafter, specs) -> list[Target]:
    """Targets bound in order (before any step: a Bind runs on the engine's thread, which _together
    holds): the i-th session's blocks are the pool's i * SESSION_BLOCKS onwards."""
    targets = []
    for seed, transport, plane in specs:
        targets.append(Target(root, "eagle3", drafter, seed=seed, transport=transport, plane=plane))
        targets[-1].client.bind()
    return targets


def _close(targets) -> None:
    for t in targets:
        t.close()


def test_three_bindings_fused_draft_what_each_drafts_alone_and_a_corrupt_one_is_refused_alone(tiny_root, ipc):
    """Host checks (the CPU drafter's sessions) over the host ring on tcp and ipc and the gloo
    channel: three steps served by one engine call draft what the in-process engine drafts and
    what a twin session (same history) drafts alone; then a step corrupt in a block id, fused with
    two good ones, is refused naming the field, the good ones exact, no KV outside theirs touched."""
    engine = _engine(tiny_root, "eagle3")
    with Drafter(engine, ipc_path=ipc) as drafter:
        a, b, c, twin = targets = _targets(tiny_root, drafter, [
            (1, "tcp", wb.HOST_RING), (2, "ipc", wb.HOST_RING), (3, "tcp", wb.GLOO_CHANNEL), (1, "tcp", wb.HOST_RING)])
        try:
            for plan in ONE:
                calls, fused, metric = _fused(drafter)
                replays = engine.graphs.replays
                steps = [Step(t, plan) for t in (a, b, c)]
                _together(drafter, steps)
                for s in steps:
                    assert s.error is None, repr(s.error)
                    assert torch.equal(s.got, s.expected), (plan, s.got, s.expected)
                assert _fused(drafter) == (calls + 1, fused + 3, metric + 3), "the three steps were not fused"
                assert engine.graphs.replays == replays + 1, "one engine call served the three steps"
                alone = Step(twin, plan)  # a's history, served alone
                alone.send()
                assert alone.error is None and torch.equal(alone.got, steps[0].got), "fused != alone"
            assert _fused(drafter)[0] == 2, "the twin's steps ran alone"

            # b's block id points into the twin's blocks (the fourth session's: 3 * 16 in the pool)
            victims = [_blocks(engine, 1), _blocks(engine, 3)]  # b's own and the twin's
            calls, fused, metric = _fused(drafter)
            steps = [Step(a, ONE[1]), Step(b, ONE[1], "block_tables[0]", 2 * SESSION_BLOCKS), Step(c, ONE[1])]
            _together(drafter, steps)
            err = steps[1].error
            assert isinstance(err, DrafterError) and err.code == Code.INVALID_ARGUMENT, repr(err)
            assert err.field == "block_tables[0]", str(err)
            for s in (steps[0], steps[2]):
                assert s.error is None and torch.equal(s.got, s.expected), repr(s.error)
            assert _fused(drafter) == (calls + 1, fused + 2, metric + 2), "the good steps were not fused"
            assert all(torch.equal(x, y) for v, now in zip(victims, [_blocks(engine, 1), _blocks(engine, 3)])
                       for x, y in zip(v, now)), "a refused step wrote KV"
            steps[1].resend()  # b's step made whole, alone: exact on its unchanged KV
        finally:
            _close(targets)


def test_guarded_bindings_fused_draft_exactly_and_a_corrupt_slot_is_masked_and_named(tiny_root, ipc, monkeypatch):
    """The GPU drafter's host ring (bound_ipc.GuardedRingSession: the step guard, forced on CPU):
    two two-request steps fused draft what the in-process engine drafts; then a step whose slot
    lies in a third session's blocks, fused with a good one, is named (slot_mappings[0]), the good
    one's drafts exact, the third session's KV bit-for-bit unchanged."""
    monkeypatch.setattr(bound_ipc, "GUARDED_RING", True)
    engine = _engine(tiny_root, "eagle3")
    with Drafter(engine, ipc_path=ipc) as drafter:
        a, b, c = targets = _targets(tiny_root, drafter, [
            (1, "tcp", wb.HOST_RING), (2, "ipc", wb.HOST_RING), (3, "tcp", wb.HOST_RING)])
        try:
            bound = drafter.server._bound_plane.sessions
            assert all(isinstance(bound[t.client.session.session_id], bound_ipc.GuardedRingSession) for t in targets)
            calls, fused, _ = _fused(drafter)
            steps = [Step(a, TWO[0]), Step(b, TWO[0])]
            _together(drafter, steps)
            for s in steps:
                assert s.error is None and torch.equal(s.got, s.expected), repr(s.error)
            assert _fused(drafter)[:2] == (calls + 1, fused + 2), "the two steps were not fused"

            victim = _blocks(engine, 2)  # c's blocks: b's bad slot is c's first one
            block_size = engine.limits.block_sizes[0]
            steps = [Step(a, TWO[1]), Step(b, TWO[1], "slot_mappings[0]", SESSION_BLOCKS * block_size)]
            _together(drafter, steps)
            err = steps[1].error
            assert isinstance(err, DrafterError) and err.code == Code.INVALID_ARGUMENT, repr(err)
            assert err.field == "slot_mappings[0]", str(err)
            assert steps[0].error is None and torch.equal(steps[0].got, steps[0].expected), repr(steps[0].error)
            assert _fused(drafter)[:2] == (calls + 2, fused + 4), "masked, the bad step ran in the fused call"
            assert all(torch.equal(x, y) for x, y in zip(victim, _blocks(engine, 2))), "wrote into c's KV"
            steps[1].resend()  # the step made whole drafts as the reference does
        finally:
            _close(targets)


def test_a_step_alone_is_not_fused(tiny_root, ipc):
    """No company, no fusion: a step whose engine lock is free runs as it always did."""
    engine = _engine(tiny_root, "eagle3")
    with Drafter(engine, ipc_path=ipc) as drafter:
        (a,) = targets = _targets(tiny_root, drafter, [(1, "ipc", wb.HOST_RING)])
        try:
            a.step(ONE[0])
            assert _fused(drafter)[:2] == (0, 0)
            assert _steps(drafter).pending() == 0
        finally:
            _close(targets)


class IpcTarget:
    """A target bound over the cuda_ipc plane on CPU (cuda_slab.LocalSlabs: one process, events order
    nothing) and its in-process reference engine (Step reads the same attributes as Target's)."""

    def __init__(self, root, drafter: Drafter, seed: int):
        self.ref = _engine(root, "eagle3", reference=True)
        self.s_ref, self.s_remote = _scenario(self.ref, seed), _scenario(self.ref, seed)
        layout = layout_for(drafter.core.info(), SESSION_BLOCKS, max_num_seqs=MAX_BATCH,
                            max_num_batched_tokens=MAX_TOKENS)
        self.client = CudaIpcBoundClient(drafter.endpoint, layout, _buffers(drafter.engine), max_batch=MAX_BATCH,
                                         device="cpu", timeout_s=60, allow_fallback=False, slabs=LocalSlabs(),
                                         armed=False)
        assert self.client.bind() == wb.CUDA_IPC

    def close(self) -> None:
        self.client.close()


def test_unarmed_cuda_ipc_bindings_fuse_and_a_corrupt_one_is_named(tiny_root, ipc, monkeypatch):
    """cuda_ipc bindings (LocalSlabs on CPU: the slab read in place, header-only steps, the guard): two
    unarmed ones' steps fused draft what the in-process engine drafts; a bad slot among them (into a
    third session's blocks) is named by the error word the target reads, the good one's drafts exact,
    the third session's KV unchanged.  (An armed binding never enters BoundSteps: IpcBoundSession._run;
    tests/integration/test_bound_armed.py keeps its steps queued ahead.)"""
    monkeypatch.setattr(bound_ipc, "BACKEND", LocalSlabs())
    engine = _engine(tiny_root, "eagle3")
    with Drafter(engine, ipc_path=ipc) as drafter:
        a, b, _ = targets = [IpcTarget(tiny_root, drafter, seed) for seed in (1, 2, 3)]
        try:
            sessions = BoundPlane.of(drafter.server).sessions
            assert not any(sessions[t.client.session.session_id].armed for t in targets)
            calls, fused, metric = _fused(drafter)
            steps = [Step(a, TWO[0]), Step(b, TWO[0])]
            _together(drafter, steps)
            for s in steps:
                assert s.error is None and torch.equal(s.got, s.expected), repr(s.error)
            assert _fused(drafter) == (calls + 1, fused + 2, metric + 2), "the two steps were not fused"

            victim = _blocks(engine, 2)
            block_size = engine.limits.block_sizes[0]
            steps = [Step(a, TWO[1]), Step(b, TWO[1], "slot_mappings[0]", SESSION_BLOCKS * block_size)]
            _together(drafter, steps)
            err = steps[1].error
            assert isinstance(err, DrafterError) and err.code == Code.INVALID_ARGUMENT, repr(err)
            assert err.field == "slot_mappings[0]", str(err)
            assert steps[0].error is None and torch.equal(steps[0].got, steps[0].expected), repr(steps[0].error)
            assert _fused(drafter)[:2] == (calls + 2, fused + 4), "masked, the bad step ran in the fused call"
            assert all(torch.equal(x, y) for x, y in zip(victim, _blocks(engine, 2))), "wrote into a third's KV"
        finally:
            _close(targets)
