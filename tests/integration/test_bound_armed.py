"""Armed cuda_ipc bindings (drafter.wire.bound.ARM_WORDS): the drafter queues each next step ahead of its
header, behind a wait for the go word the target copies after its inputs.

On CPU (cuda_slab.LocalSlabs, one process, the doorbell a real UNIX-domain connection) a queued step is
kept by the binding and run once the go word has reached it, which is what the GPU's wait does: the
logic above it (a step queued ahead and found queued, one queued for other sizes doing nothing and the
step queued again, another user of the engine draining the binding) runs as on a GPU, and the drafts
must equal an in-process engine's at every step.  tests/gpu/test_bound_armed.py runs it over CUDA IPC
and the driver's stream memory operations.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_bound_ipc import IpcTarget, _blocks_of_a, _corrupt  # noqa: E402
from tests.integration.test_bound_remote import PADDING, PLANS, Drafter, _engine, _fill  # noqa: E402

from drafter.service import bound_ipc  # noqa: E402
from drafter.service.engine_lock import EngineLock  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from drafter.wire import doorbell  # noqa: E402
from drafter.wire.cuda_slab import LocalSlabs  # noqa: E402
from drafter.wire.errors import Code, DrafterError  # noqa: E402

pytestmark = pytest.mark.skipif(not doorbell.available(), reason="abstract UNIX-domain sockets are Linux's")


@pytest.fixture(autouse=True)
def _local_slabs(monkeypatch):
    monkeypatch.setattr(bound_ipc, "BACKEND", LocalSlabs())


def _armed(drafter, root, seed: int) -> IpcTarget:
    t = IpcTarget(root, "eagle3", drafter, seed=seed)
    t.client.armed = True
    return t


def _binding(drafter, t: IpcTarget):
    return drafter.server._bound_plane.sessions[t.client.session.session_id]


def _settled(t: IpcTarget) -> None:
    """Return once the binding's doorbell thread is done with the last step (its queueing ahead
    included): it answers the frames in order, so the answer to a header for another binding
    (refused before any engine work) comes after."""
    bell = t.client.link.bell
    bell.send(wb.encode(wb.StepHeader(step=10**6, num_tokens=1, batch=1, bind_id="0" * 32)))
    done = wb.DONE_DECODER.decode(doorbell.receive(bell, 60))
    assert (done.step, done.field) == (10**6, "bind_id"), done


def test_armed_steps_queued_ahead_draft_what_in_process_drafts(tiny_root):
    """Steps of one size find their step queued ahead (nothing queued at the header); a step of
    other sizes finds the one queued ahead doing nothing and drafts exactly all the same."""
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = _armed(drafter, tiny_root, seed=1)
        try:
            for plan in (PLANS[0], PLANS[0], PLANS[0], PLANS[1], PLANS[1], PLANS[0]):
                t.step(plan)
            b = _binding(drafter, t)
            assert t.client.link.armed and b.armed, "the drafter granted the armed binding"
            assert b.armed_steps == 6
            # steps 1, 4 (other sizes than queued), 6 (other sizes) and 2 (queued ahead only after the
            # engine had one owner across a step) are queued at their header; 3 and 5 were queued ahead
            assert b.armed_hits == 2, b.armed_hits
            metric = drafter.core.metrics.registry.get_sample_value
            assert metric("drafter_bound_armed_steps_total", {"queued_ahead": "true"}) == 2
            assert metric("drafter_bound_armed_steps_total", {"queued_ahead": "false"}) == 4
            assert drafter.core.executor.engine_lock.armed is b, "the next step is queued ahead"
        finally:
            t.client.close()


def test_another_user_of_the_engine_drains_the_armed_binding(tiny_root):
    """A second (unarmed) binding's steps between the armed one's: each takes the engine's lock,
    which releases the step queued ahead (it does nothing: its record is not there); both bindings
    draft what in-process drafts, and the armed one queues ahead again once it is alone."""
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        a = _armed(drafter, tiny_root, seed=1)
        other = IpcTarget(tiny_root, "eagle3", drafter, seed=2)
        lock = drafter.core.executor.engine_lock
        assert isinstance(lock, EngineLock)
        try:
            for _ in range(2):  # the first step binds and sees the engine change hands
                a.step(PLANS[0])
            _settled(a)
            b = _binding(drafter, a)
            assert b._ahead is not None and lock.armed is b
            # a's next inputs written (the target has not started the step yet), then another user drains
            # a's step queued ahead: released without its record, it must read and write nothing
            expected = a.ref.propose(**a.s_ref.call(PLANS[0]).kwargs).draft_token_ids
            n, nb = _fill(a.client.views, a.s_remote.call(PLANS[0]).kwargs)
            words = b.drafts.numel() + 1  # the drafts and the error word (the arm row follows)
            before = b.output[:words].clone()
            released, half = b._queued, b._half
            other.step(PLANS[0])
            assert b._ahead is None and not b._deferred and lock.armed is not b
            assert torch.equal(b.output[:words], before), "the released step wrote drafts"
            # the go word it released is not the one waited on next: the step's own go is still waited for
            assert b._half != half and int(b.go[half]) == released and int(b.go[b._half]) == released - 1
            hits = b.armed_hits
            assert torch.equal(a.client.step(n, nb, **PADDING), expected)  # queued at its header
            other.step(PLANS[1])
            a.step(PLANS[0])
            assert b.armed_hits == hits, "with another user between its steps, the binding queues nothing ahead"
            a.step(PLANS[0])
            a.step(PLANS[0])
            assert b.armed_hits > hits, "alone again, the binding queues ahead again"
        finally:
            a.client.close()
            other.client.close()


def test_a_corrupt_armed_step_is_named_and_leaves_the_other_sessions_kv_untouched(tiny_root):
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        a = IpcTarget(tiny_root, "eagle3", drafter, seed=1)
        t = _armed(drafter, tiny_root, seed=2)
        try:
            a.step(PLANS[0])
            t.step(PLANS[0])
            t.step(PLANS[0])
            mine = _blocks_of_a(drafter.engine)
            call = t.s_remote.call(PLANS[0]).kwargs
            n, nb = _fill(t.client.views, call)
            _corrupt(t.client.views, "block_tables[0]", n, nb)
            with pytest.raises(DrafterError) as err:
                t.client.step(n, nb, **PADDING)  # the step queued ahead: its guard masks and names the field
            assert err.value.code == Code.INVALID_ARGUMENT and err.value.field == "block_tables[0]", str(err.value)
            assert all(torch.equal(x, y) for x, y in zip(mine, _blocks_of_a(drafter.engine)))
        finally:
            a.client.close()
            t.client.close()


def test_the_go_word_compares_cyclically():
    assert bound_ipc._reached(5, 5) and bound_ipc._reached(6, 5) and not bound_ipc._reached(4, 5)
    assert bound_ipc._reached(2, 0xFFFFFFFE) and not bound_ipc._reached(0xFFFFFFFE, 2)  # past the wrap


def test_the_engine_lock_drains_an_armed_binding_for_any_other_owner():
    drained = []

    class Armed:
        def drain(self):
            drained.append(self)

    lock, armed = EngineLock(), Armed()
    lock.armed = armed
    with lock:  # the engine thread (no owner)
        pass
    assert drained == [armed] and lock.armed is None
    lock.armed = armed
    lock.acquire(owner=armed)  # the binding itself
    lock.release()
    assert drained == [armed] and lock.armed is armed
    switches = lock.switches
    lock.acquire(owner=armed)
    lock.release()
    assert lock.switches == switches, "the same owner again is no switch"
    assert lock.acquire(owner=armed)
    assert not lock.acquire(False, owner=object()), "held: another owner does not get it"
    lock.release()
    assert drained == [armed], "nothing drained by an acquire that failed"
