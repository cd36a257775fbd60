"""The cuda_ipc plane of bound sessions on CPU (drafter.service.bound_ipc, coordinator.transport.bound_ipc).

The shared memory and the events are cuda_slab.LocalSlabs (one process: a handle names a tensor,
events order nothing), everything else is the plane as it runs on a GPU: the target's slab read in
place by the drafter, header-only steps, the step guard masking every field into the session's
range and the error word read back with the drafts.  tests/gpu/test_bound_ipc.py runs it over real
CUDA IPC.  Drafts must equal an in-process engine's; a corrupt field must be named and must leave
the other session's KV bit-for-bit unchanged.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.integration.test_bound_remote import (MAX_BATCH, PADDING, PLANS, SESSION_BLOCKS, Drafter,  # noqa: E402
                                                 _buffers, _engine, _fill, _scenario)

from coordinator.transport.bound_ipc import CudaIpcBoundClient  # noqa: E402
from drafter.service import bound_ipc  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from drafter.wire.cuda_slab import LocalSlabs  # noqa: E402
from drafter.wire.errors import Code, DrafterError  # noqa: E402
from tests.support.servers import layout_for  # noqa: E402

MAX_TOKENS = 32


@pytest.fixture(autouse=True)
def _local_slabs(monkeypatch):
    monkeypatch.setattr(bound_ipc, "BACKEND", LocalSlabs())


class IpcTarget:
    """One target bound over the (local) cuda_ipc plane, and an in-process reference engine."""

    def __init__(self, root, method, drafter: Drafter, seed: int, host_wait: bool = False):
        self.ref = _engine(root, method, reference=True)
        self.s_ref, self.s_remote = _scenario(self.ref, seed), _scenario(self.ref, seed)
        info = drafter.core.info()
        layout = layout_for(info, SESSION_BLOCKS, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_TOKENS)
        self.client = CudaIpcBoundClient(drafter.endpoint, layout, _buffers(drafter.engine), max_batch=MAX_BATCH,
                                         device="cpu", timeout_s=60, allow_fallback=False, slabs=LocalSlabs(),
                                         host_wait=host_wait)

    def step(self, plan) -> None:
        expected = self.ref.propose(**self.s_ref.call(plan).kwargs).draft_token_ids
        n, b = _fill(self.client.views, self.s_remote.call(plan).kwargs)
        got = self.client.step(n, b, **PADDING)
        assert torch.equal(got, expected), plan
        if self.client.plane == wb.CUDA_IPC:  # both sides' perf_counter_ns, in the order the step passed them
            stamps = self.client.stamps
            order = ["sent", *wb.STAMPS, "answered", "read"]
            assert [stamps[k] for k in order] == sorted(stamps[k] for k in order), stamps
        else:
            assert self.client.stamps == {}, "the host ring is not stamped"


def test_cuda_ipc_plane_drafts_equal_in_process(tiny_root):
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        a = IpcTarget(tiny_root, "eagle3", drafter, seed=1)
        b = IpcTarget(tiny_root, "eagle3", drafter, seed=2, host_wait=True)  # the host waits, not the stream
        replays = drafter.engine.graphs.replays  # the engine (and its graphs) serve the whole module
        try:
            for plan in PLANS:
                a.step(plan)
                b.step(plan)  # the second session's blocks start past the first's: moved there by the guard
            assert a.client.plane == b.client.plane == wb.CUDA_IPC
            assert drafter.engine.graphs.replays == replays + 4, "every step replayed the bound graphs"
            session = drafter.server._bound_plane.sessions[b.client.session.session_id]
            assert session.slab is LocalSlabs.REGISTRY[next(
                h for h, t in LocalSlabs.REGISTRY.items() if t is b.client.slab)], "the target's slab, in place"
        finally:
            a.client.close()
            b.client.close()


def _corrupt(views, field: str, n: int, b: int) -> None:
    """One field of the step written out of the session's range (as a buggy or hostile target might)."""
    bad = {"target_token_ids": lambda: views[field].__setitem__(1, 10**6),
           "target_positions": lambda: views[field].__setitem__(n - 1, 10**4),
           wb.HIDDEN: lambda: views[field].__setitem__((n // 2, 1), float("nan")),
           "next_token_ids": lambda: views[field].__setitem__(0, -4),
           "query_start_loc": lambda: views[field].__setitem__(b, n + 1),
           "seq_lens": lambda: views[field].__setitem__(b - 1, 10**4),
           "block_tables[0]": lambda: views[field].__setitem__((b - 1, 0), -SESSION_BLOCKS),  # the previous session's
           "slot_mappings[0]": lambda: views[field].__setitem__(n - 1, -5),
           "token_indices_to_sample": lambda: views[field].__setitem__(0, n),
           "num_rejected_tokens": lambda: views[field].__setitem__(0, 9)}
    bad[field]()


def _blocks_of_a(engine) -> list[torch.Tensor]:
    """Session a's blocks (0 .. SESSION_BLOCKS - 1) of every KV layer (the blocks dim: 1 of a 5-D K/V pair)."""
    return [t.narrow(1 if t.dim() == 5 else 0, 0, SESSION_BLOCKS) for t in engine.kv_snapshot()]


def test_corrupt_steps_are_named_and_leave_the_other_sessions_kv_untouched(tiny_root):
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        a = IpcTarget(tiny_root, "eagle3", drafter, seed=1)
        b = IpcTarget(tiny_root, "eagle3", drafter, seed=2)
        try:
            a.step(PLANS[0])
            b.step(PLANS[0])
            assert set(drafter.core.sessions.get(a.client.session.session_id).bases) == {0}
            mine = _blocks_of_a(drafter.engine)
            call = b.s_remote.call(PLANS[1]).kwargs
            # every field is named by the guard's unit tests (tests/unit/test_step_guard.py); here the
            # ones that steer KV writes or reads, each a full step under the Triton interpreter
            fields = ["block_tables[0]", "slot_mappings[0]", wb.HIDDEN, "target_positions", "seq_lens"]
            for field in fields:
                n, nb = _fill(b.client.views, call)
                _corrupt(b.client.views, field, n, nb)
                with pytest.raises(DrafterError) as err:
                    b.client.step(n, nb, **PADDING)
                assert err.value.code == Code.INVALID_ARGUMENT and err.value.field == field, str(err.value)
                now = _blocks_of_a(drafter.engine)
                assert all(torch.equal(x, y) for x, y in zip(mine, now)), f"{field} wrote into another session's KV"
            a.step(PLANS[1])  # the neighbour drafts as if nothing happened
        finally:
            a.client.close()
            b.client.close()


def test_a_drafter_without_cuda_ipc_is_refused_by_field_and_the_client_falls_back(tiny_root, monkeypatch):
    """Over real CUDA IPC on a drafter that does not serve it the Bind is refused naming
    slab.device_uuid; the client then binds the host ring and drafts the same."""
    monkeypatch.setattr(bound_ipc, "BACKEND", None)  # TorchSlabs: this CPU drafter does not serve CUDA IPC
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = IpcTarget(tiny_root, "eagle3", drafter, seed=1)
        t.client.allow_fallback = True
        try:
            t.step(PLANS[0])
            assert t.client.plane == wb.HOST_RING
            assert "slab.device_uuid" in t.client.fallback_reason
            t.step(PLANS[1])
            assert len(drafter.core.sessions.sessions) == 1, "the refused session was detached"
        finally:
            t.client.close()


def test_the_guarded_host_ring_drafts_equal_and_names_a_corrupt_step(tiny_root, monkeypatch):
    """The host ring as a GPU drafter serves it (bound_ipc.GuardedRingSession: the frame copied to
    the engine's device, the step guard, the bound graphs; forced here on CPU): drafts equal the
    in-process engine's; a slot out of the session's range is named and writes nothing into another
    session's KV."""
    from tests.integration.test_bound_remote import Target

    monkeypatch.setattr(bound_ipc, "GUARDED_RING", True)
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        a = IpcTarget(tiny_root, "eagle3", drafter, seed=1)
        b = Target(tiny_root, "eagle3", drafter, seed=2)
        try:
            a.step(PLANS[0])
            b.step(PLANS[0])
            session = drafter.server._bound_plane.sessions[b.client.session.session_id]
            assert isinstance(session, bound_ipc.GuardedRingSession)
            mine = _blocks_of_a(drafter.engine)
            call = b.s_remote.call(PLANS[1]).kwargs
            n, nb = _fill(b.client.views, call)
            _corrupt(b.client.views, "slot_mappings[0]", n, nb)
            with pytest.raises(DrafterError) as err:
                b.client.step(n, nb, **PADDING)
            assert err.value.code == Code.INVALID_ARGUMENT and err.value.field == "slot_mappings[0]", str(err.value)
            assert all(torch.equal(x, y) for x, y in zip(mine, _blocks_of_a(drafter.engine))), "wrote into a's KV"
            a.step(PLANS[1])
            b.step(PLANS[1], call)  # the step made whole drafts as the reference does
        finally:
            a.client.close()
            b.client.close()


def _bound_session(drafter, proposer):
    """The drafter's binding of the proposer's session."""
    return drafter.server._bound_plane.sessions[proposer.session.session_id]


def test_the_remote_proposer_binds_over_cuda_ipc_and_drafts_equal_in_process(tiny_root, monkeypatch):
    """BoundConfig(device=...) names where the target's tensors live: the RemoteProposer binds
    the cuda_ipc plane at attach (its slab read in place by the drafter), each step copies its
    tensors into the slab and sends the header alone; drafts equal the in-process engine's, the
    accepted counts reach the drafter's acceptance metrics, a corrupt step is refused naming the
    field (no drafts, the breaker untouched)."""
    from coordinator.transport import bound_transport
    from coordinator.transport.bound_ipc import IpcLink
    from tests.integration.test_bound_remote import ProposerTarget

    monkeypatch.setattr(bound_transport, "SLABS", LocalSlabs())
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        p = ProposerTarget(tiny_root, "eagle3", drafter, seed=4, device="cpu")
        try:
            assert p.proposer.start(), "attached"
            transport = p.transport
            assert isinstance(transport.link, IpcLink), "bound over cuda_ipc at attach"
            assert transport.link.bell is not None, f"steps by the doorbell: {transport.link.bell_reason}"
            assert not transport.link.host_wait, "the drafter is not on the target's GPU: the stream waits"
            session = _bound_session(drafter, p.proposer)
            assert isinstance(session, bound_ipc.IpcBoundSession)
            assert session.slab is transport._slab.slab, "the drafter reads the proposer's slab in place"
            assert p.step(PLANS[0]) is not None
            metrics = drafter.core.metrics
            verified = metrics._verified.get(1, 0)
            expected = p.ref.propose(**p.s_ref.call(PLANS[1]).kwargs).draft_token_ids
            got = p.proposer.propose(**p.s_remote.call(PLANS[1]).kwargs, accepted_counts=torch.tensor([2, -1, 1]),
                                     **PADDING)
            assert got is not None and torch.equal(got, expected)
            assert transport.steps == {"bound": 2, "unbound": 0}
            bad = p.s_remote.call(PLANS[1]).kwargs
            bad["slot_mappings"][0][-1] = -5
            assert p.proposer.propose(**bad, **PADDING) is None
            assert p.proposer.stats.no_drafts.get("invalid_argument") == 1
            # counted after the step's reply, before the session's data thread takes the next step
            assert metrics._verified.get(1, 0) == verified + 2, "the two reported rows were counted"
            assert transport.steps["bound"] == 3 and transport.link.alive, "refused there; the binding stays"
            # a step naming another binding (an earlier one of this session) is refused by the drafter
            head = wb.StepHeader(step=999, num_tokens=13, batch=3, bind_id="0" * 32)
            transport.link.sock.send(wb.encode(head))
            assert transport.link.sock.poll(60_000)
            done = wb.DONE_DECODER.decode(transport.link.sock.recv_multipart()[0])
            assert (done.step, done.code, done.field) == (999, Code.FAILED_PRECONDITION, "bind_id"), done
        finally:
            p.close()


def test_the_remote_proposer_learns_the_plane_from_its_tensors_and_binds_again_after_a_restart(
        tiny_root, monkeypatch):
    """Without BoundConfig.device the first step's tensors say where they live: the host-ring
    binding made at attach gives way to a cuda_ipc one (that step goes unbound, exact); a drafter
    restarted on the same port is attached and bound over cuda_ipc again by the proposer itself,
    and no step returns drafts other than the in-process engine's."""
    from coordinator.transport import bound_transport
    from coordinator.transport.bound_ipc import IpcLink
    from tests.integration.test_bound_remote import ProposerTarget

    monkeypatch.setattr(bound_transport, "SLABS", LocalSlabs())
    engine = _engine(tiny_root, "eagle3")
    first = Drafter(engine).__enter__()
    p = ProposerTarget(tiny_root, "eagle3", first, seed=5)
    try:
        assert p.proposer.start()
        transport = p.transport
        assert transport.link.plane == wb.HOST_RING, "where the tensors live is not known at attach"
        assert p.step(PLANS[0]) is not None
        # the step that found the plane went unbound, unless the new binding was ready before it was sent
        assert transport.steps["unbound"] + transport.steps["bound"] == 1
        transport._advance(p.proposer.session, time.monotonic() + 60)  # the cuda_ipc Bind's reply
        assert isinstance(transport.link, IpcLink)
        bound = transport.steps["bound"]
        assert p.step(PLANS[1]) is not None
        assert transport.steps["bound"] == bound + 1, "over cuda_ipc"
        first.__exit__(None, None, None)
        second = Drafter(engine, port=first.port).__enter__()
        try:
            generation, misses = p.proposer.generation, 0
            while p.proposer.generation == generation:
                assert p.step(PLANS[1]) is None, "a step on the dead binding returned drafts"
                misses += 1
                assert misses <= 3, list(p.proposer.events)
            p.reset(seed=6)
            assert isinstance(transport.link, IpcLink), "bound over cuda_ipc again at the re-attach"
            bound = transport.steps["bound"]
            assert p.step(PLANS[0]) is not None
            assert transport.steps["bound"] == bound + 1
            assert isinstance(_bound_session(second, p.proposer), bound_ipc.IpcBoundSession)
        finally:
            p.close()
            second.__exit__(None, None, None)
    finally:
        p.close()
        if first._thread.is_alive():
            first.__exit__(None, None, None)
