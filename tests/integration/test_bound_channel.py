"""The nccl_channel plane of bound sessions on CPU, its NCCL replaced by gloo.

drafter.service.bound_channel.ChannelSession and coordinator.transport.bound_channel.ChannelLink
run as they run between two GPUs: the group built from the drafter's TCPStore, the handshake, the
slab's prefix sent down the channel into the drafter's slab, the step guard masking every field,
the whole output (drafts, error word) sent back down the channel after StepDone; only the group's
backend is gloo (both modules' BACKEND) and the tensors are on the host.  tests/gpu/test_bound_nccl.py
runs it over NCCL between two GPUs.  Drafts must equal an in-process engine's; a corrupt field is
named and leaves the other session's KV bit-for-bit unchanged; a drafter that cannot serve the plane
(no GPU engine, or the target's own GPU) refuses it naming the field and the client falls back.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_bound_remote import (MAX_BATCH, PADDING, PLANS, SESSION_BLOCKS, Drafter,  # noqa: E402
                                                 _buffers, _engine, _fill, _scenario)
from tests.integration.test_bound_ipc import _blocks_of_a, _corrupt  # noqa: E402

from coordinator.transport import bound_channel as client_channel  # noqa: E402
from coordinator.transport.bound_ipc import CudaIpcBoundClient  # noqa: E402
from drafter.service import bound_channel  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from drafter.wire import bound_channel as bc  # noqa: E402
from drafter.wire.errors import Code, DrafterError  # noqa: E402
from tests.support.servers import layout_for  # noqa: E402

MAX_TOKENS = 32


@pytest.fixture(autouse=True)
def _gloo(monkeypatch):
    monkeypatch.setattr(bound_channel, "BACKEND", bc.GLOO)
    monkeypatch.setattr(client_channel, "BACKEND", bc.GLOO)


class ChannelTarget:
    """One target bound over the (gloo) nccl_channel plane, and an in-process reference engine."""

    def __init__(self, root, method, drafter: Drafter, seed: int, allow_fallback: bool = False):
        self.ref = _engine(root, method, reference=True)
        self.s_ref, self.s_remote = _scenario(self.ref, seed), _scenario(self.ref, seed)
        info = drafter.core.info()
        layout = layout_for(info, SESSION_BLOCKS, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_TOKENS)
        self.client = CudaIpcBoundClient(drafter.endpoint, layout, _buffers(drafter.engine), max_batch=MAX_BATCH,
                                         device="cpu", timeout_s=60, allow_fallback=allow_fallback, channel=True)

    def step(self, plan) -> None:
        expected = self.ref.propose(**self.s_ref.call(plan).kwargs).draft_token_ids
        n, b = _fill(self.client.views, self.s_remote.call(plan).kwargs)
        got = self.client.step(n, b, **PADDING)
        assert torch.equal(got, expected), plan


def test_nccl_channel_plane_drafts_equal_in_process_and_a_corrupt_step_is_named(tiny_root):
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        a = ChannelTarget(tiny_root, "eagle3", drafter, seed=1)
        b = ChannelTarget(tiny_root, "eagle3", drafter, seed=2)
        try:
            a.step(PLANS[0])
            b.step(PLANS[0])  # the second session's blocks start past the first's: moved there by the guard
            assert a.client.plane == b.client.plane == wb.NCCL_CHANNEL
            session = drafter.server._bound_plane.sessions[b.client.session.session_id]
            assert isinstance(session, bound_channel.ChannelSession)
            assert session.ring.numel() == 0, "no bytes on the data socket: the channel carries them"
            stamps = b.client.stamps
            order = ["sent", *wb.STAMPS, "answered", "read"]
            assert [stamps[k] for k in order] == sorted(stamps[k] for k in order), stamps
            mine = _blocks_of_a(drafter.engine)
            call = b.s_remote.call(PLANS[1]).kwargs
            for field in ("slot_mappings[0]", "block_tables[0]"):
                n, nb = _fill(b.client.views, call)
                _corrupt(b.client.views, field, n, nb)
                with pytest.raises(DrafterError) as err:
                    b.client.step(n, nb, **PADDING)
                assert err.value.code == Code.INVALID_ARGUMENT and err.value.field == field, str(err.value)
                assert all(torch.equal(x, y) for x, y in zip(mine, _blocks_of_a(drafter.engine))), field
            assert b.client.link.alive, "a masked step keeps the binding (both ends' transfers stayed paired)"
            # a step the drafter refuses on the host sends no output; the next step still pairs up
            with pytest.raises(DrafterError) as err:
                b.client.step(MAX_TOKENS, MAX_BATCH + 1)
            assert err.value.field == "batch_size", str(err.value)
            a.step(PLANS[1])  # the neighbour drafts as if nothing happened
        finally:
            a.client.close()
            b.client.close()


def test_a_drafter_that_cannot_serve_nccl_refuses_by_field_and_the_client_falls_back(tiny_root, monkeypatch):
    """With NCCL (not gloo) a CPU drafter refuses the plane naming "plane"; the client binds the host
    ring and drafts the same."""
    monkeypatch.setattr(bound_channel, "BACKEND", bc.NCCL)
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = ChannelTarget(tiny_root, "eagle3", drafter, seed=1, allow_fallback=True)
        try:
            t.step(PLANS[0])
            assert t.client.plane == wb.HOST_RING
            assert "the drafter refused plane" in t.client.fallback_reason, t.client.fallback_reason
            t.step(PLANS[1])
        finally:
            t.client.close()


def test_a_bind_that_fails_gives_its_session_back(tiny_root, monkeypatch):
    """Without a fallback the refused plane raises, and the session the client attached for it is
    detached: a failed bind holds none of the drafter's KV blocks."""
    monkeypatch.setattr(bound_channel, "BACKEND", bc.NCCL)
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = ChannelTarget(tiny_root, "eagle3", drafter, seed=1)
        try:
            with pytest.raises(DrafterError) as err:
                t.client.bind()
            assert (err.value.code, err.value.field) == (Code.FAILED_PRECONDITION, "plane"), str(err.value)
            assert len(drafter.core.sessions.sessions) == 0, "the refused plane's session was detached"
        finally:
            t.client.close()


def test_the_targets_own_gpu_is_refused_naming_device_uuid(monkeypatch):
    """NCCL refuses two ranks on one GPU: a Bind naming the drafter's own GPU is FAILED_PRECONDITION
    "device_uuid" (checked before anything is allocated)."""

    class Engine:
        device = "cuda:1"

    monkeypatch.setattr(bound_channel, "BACKEND", bc.NCCL)
    monkeypatch.setattr(bc, "nccl_available", lambda: True)
    monkeypatch.setattr(bound_channel.cuda_ref, "device_uuid", lambda device: f"GPU-{torch.device(device).index}")
    with pytest.raises(DrafterError) as err:
        bound_channel.check_plane(Engine(), wb.BindRequest(plane=wb.NCCL_CHANNEL, device_uuid="GPU-1"))
    assert (err.value.code, err.value.field) == (Code.FAILED_PRECONDITION, "device_uuid")
    assert "two ranks on one GPU" in err.value.message
    assert bound_channel.check_plane(Engine(), wb.BindRequest(plane=wb.NCCL_CHANNEL, device_uuid="GPU-0")) \
        == torch.device("cuda", 1)
    with pytest.raises(DrafterError) as err:
        bound_channel.check_plane(Engine(), wb.BindRequest(plane=wb.NCCL_CHANNEL))
    assert err.value.field == "device_uuid"


def test_the_remote_proposer_over_the_channel_drafts_equal_in_process_and_a_named_refusal_stays_unbound(tiny_root):
    """BoundConfig(plane="nccl_channel") (gloo here): bound at attach, each step's tensors copied into
    the slab, sent down the channel, drafts equal the in-process engine's; a corrupt step is None
    with INVALID_ARGUMENT counted and the binding kept.  With NCCL itself (which this CPU drafter
    refuses naming "plane") the named plane is not replaced: the session stays unbound, asked once."""
    from coordinator.transport.bound_channel import ChannelLink
    from tests.integration.test_bound_remote import ProposerTarget

    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        p = ProposerTarget(tiny_root, "eagle3", drafter, seed=4, plane=wb.NCCL_CHANNEL, device="cpu")
        try:
            assert p.proposer.start(), "attached"
            transport = p.transport
            assert isinstance(transport.link, ChannelLink), "bound over the channel at attach"
            assert isinstance(drafter.server._bound_plane.sessions[p.proposer.session.session_id],
                              bound_channel.ChannelSession)
            assert p.step(PLANS[0]) is not None and p.step(PLANS[1]) is not None
            assert transport.steps == {"bound": 2, "unbound": 0}
            bad = p.s_remote.call(PLANS[1]).kwargs
            bad["slot_mappings"][0][-1] = -5
            assert p.proposer.propose(**bad, **PADDING) is None
            assert p.proposer.stats.no_drafts.get("invalid_argument") == 1
            assert transport.link.alive, "refused there; the binding stays"
        finally:
            p.close()


def test_a_named_nccl_channel_the_drafter_refuses_leaves_the_session_unbound(tiny_root, monkeypatch):
    from tests.integration.test_bound_remote import ProposerTarget

    monkeypatch.setattr(bound_channel, "BACKEND", bc.NCCL)  # this CPU drafter refuses NCCL naming "plane"
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        p = ProposerTarget(tiny_root, "eagle3", drafter, seed=4, plane=wb.NCCL_CHANNEL, device="cpu")
        try:
            assert p.proposer.start(), "attached"
            transport = p.transport
            assert transport.link is None and transport._refused == p.proposer.session.session_id
            assert p.step(PLANS[0]) is not None
            assert transport.steps == {"bound": 0, "unbound": 1} and transport._pending is None, "not asked again"
        finally:
            p.close()


def test_no_channel_transfer_is_posted_under_the_engines_lock(tiny_root, monkeypatch):
    """A transfer call may block (NCCL connects a direction inside its first call there, and a peer
    that went away never completes one): the drafter posts every send and recv of a step outside
    on_engine (the engine's lock), so a stuck channel stalls its own binding only, never another
    session's step or a Bind.  The session's group is wrapped to record where each call came from."""
    import threading

    inside = threading.local()
    real = bound_channel.on_engine

    def on_engine(session, fn, *args):
        inside.held = True
        try:
            return real(session, fn, *args)
        finally:
            inside.held = False

    class Recording:
        def __init__(self, group):
            self.group, self.calls = group, []

        def send(self, *args):
            self.calls.append(("send", getattr(inside, "held", False)))
            return self.group.send(*args)

        def recv(self, *args):
            self.calls.append(("recv", getattr(inside, "held", False)))
            return self.group.recv(*args)

        def __getattr__(self, name):
            return getattr(self.group, name)

    monkeypatch.setattr(bound_channel, "on_engine", on_engine)
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = ChannelTarget(tiny_root, "eagle3", drafter, seed=1)
        try:
            t.step(PLANS[0])  # bound, the handshake done
            session = drafter.server._bound_plane.sessions[t.client.session.session_id]
            recording = session.channel = Recording(session.channel)
            t.step(PLANS[1])
            assert [op for op, _ in recording.calls] == ["recv", "send"], recording.calls
            assert not any(held for _, held in recording.calls), f"a transfer under the engine's lock: {recording.calls}"
        finally:
            t.client.close()
