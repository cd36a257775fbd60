"""cuda_ipc steps over the binding's same-host doorbell (drafter.wire.doorbell), and its fallback.

The plane runs as in tests/integration/test_bound_ipc.py (cuda_slab.LocalSlabs: one process, a
drafter service on its own event loop thread), the doorbell is a real UNIX-domain connection
between the target's thread and the binding's doorbell thread.  Drafts over it must equal an
in-process engine's, with the ZMQ data socket closed under it (so the doorbell carried the step);
where the doorbell cannot be had (a drafter that offers none, one the target cannot reach, a
drafter from before the doorbell) the steps go over the data socket and draft the same; a drafter
that hangs or goes away mid-step ends the step within the deadline (DEADLINE_EXCEEDED, UNAVAILABLE)
and the client binds again by itself; a target that goes away ends the binding's doorbell thread.
The nccl_channel plane (gloo here) takes its header by the doorbell the same way.
"""

from __future__ import annotations

import threading
from typing import ClassVar

import msgspec
import pytest
import torch

from tests.integration.test_bound_ipc import IpcTarget  # noqa: E402  (sets the interpreter up first)
from tests.integration.test_bound_remote import PADDING, PLANS, Drafter, _engine, _fill, _scenario  # noqa: E402

from drafter.service import bound_ipc  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from drafter.wire import doorbell  # noqa: E402
from drafter.wire.cuda_slab import LocalSlabs  # noqa: E402
from drafter.wire.errors import Code, DrafterError  # noqa: E402

pytestmark = pytest.mark.skipif(not doorbell.available(), reason="abstract UNIX-domain sockets are Linux's")


@pytest.fixture(autouse=True)
def _local_slabs(monkeypatch):
    monkeypatch.setattr(bound_ipc, "BACKEND", LocalSlabs())


def _binding(drafter, target: IpcTarget):
    return drafter.server._bound_plane.sessions[target.client.session.session_id]


def test_steps_over_the_doorbell_draft_what_in_process_drafts(tiny_root):
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = IpcTarget(tiny_root, "eagle3", drafter, seed=1)
        t.client.spin_us = 2000  # the drafter polls the doorbell 2 ms after each reply before it sleeps
        try:
            t.step(PLANS[0])
            link = t.client.link
            assert link.bell is not None, link.bell_reason
            link.sock.close(linger=0)  # the data socket gone: only the doorbell can carry the next step
            t.step(PLANS[1])
            order = ["sent", "received", "started", *wb.FINE_STAMPS, "queued", "replied", "answered", "read"]
            stamps = t.client.stamps
            assert [stamps[k] for k in order] == sorted(stamps[k] for k in order), stamps
            # a step naming another binding (an earlier one of this session) is refused there too; sent
            # back to back with a garbled one, which the drafter's spin after the first reply picks up
            link.bell.send(wb.encode(wb.StepHeader(step=999, num_tokens=13, batch=3, bind_id="0" * 32)))
            link.bell.send(b"\xc1 not a header")
            done = wb.DONE_DECODER.decode(doorbell.receive(link.bell, 60))
            assert (done.step, done.code, done.field) == (999, Code.FAILED_PRECONDITION, "bind_id"), done
            done = wb.DONE_DECODER.decode(doorbell.receive(link.bell, 60))
            assert (done.code, done.field) == (Code.INVALID_ARGUMENT, "header"), done
            # a WAKE (older clients rang one before filling) is dropped; a header after it is answered as any
            link.bell.send(doorbell.WAKE)
            link.bell.send(doorbell.WAKE)  # rung twice: still nothing to answer
            link.bell.send(wb.encode(wb.StepHeader(step=1000, num_tokens=13, batch=3, bind_id="1" * 32)))
            done = wb.DONE_DECODER.decode(doorbell.receive(link.bell, 60))
            assert (done.step, done.field) == (1000, "bind_id"), done
            assert doorbell.receive(link.bell, 0.2) is None, "nothing else was answered"
        finally:
            t.client.close()


class _BindRequestBefore(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """BindRequest as a drafter from before the doorbell decodes it."""

    session_id: str = ""
    epoch: int = 0
    plane: str = wb.HOST_RING
    transport: str = "tcp"
    buffers: list[wb.BufferSpec] = []
    max_batch: int = 0
    slab: wb.CudaIpcTensor | None = None
    device_uuid: str = ""
    doorbell: ClassVar[bool] = False
    spin_us: ClassVar[int] = 0


@pytest.mark.parametrize("why", ["none offered", "unreachable", "older drafter"])
def test_without_a_doorbell_the_data_socket_carries_the_steps(tiny_root, monkeypatch, why):
    if why == "none offered":
        monkeypatch.setattr(doorbell, "available", lambda: False)  # the drafter's side asks this alone
    elif why == "unreachable":  # another network namespace: the name is not there for the target
        def refused(*_a, **_k):
            raise ConnectionRefusedError("not reachable from here")
        monkeypatch.setattr(doorbell, "connect", refused)
    else:
        monkeypatch.setattr(wb, "BIND_DECODER", msgspec.msgpack.Decoder(_BindRequestBefore))
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = IpcTarget(tiny_root, "eagle3", drafter, seed=3)
        try:
            t.step(PLANS[0])
            assert t.client.plane == wb.CUDA_IPC and t.client.link.bell is None
            assert t.client.link.bell_reason
            assert _binding(drafter, t).doorbell_address == ("" if why != "unreachable" else
                                                             t.client.link.resp.doorbell)
        finally:
            t.client.close()


def test_a_drafter_that_hangs_or_goes_away_mid_step_ends_the_step_and_is_bound_again(tiny_root, monkeypatch):
    gate = threading.Event()
    answer = bound_ipc.IpcBoundSession._answer
    mode = {"now": ""}

    def misbehaving(self, frame, extra, received):
        if mode["now"] == "hang":
            gate.wait(30)  # released at the end of the test
            return wb.StepDone(step=0, code=int(Code.INTERNAL), message="released"), []
        if mode["now"] == "gone":
            raise ConnectionResetError("the drafter's end went away")  # the doorbell thread ends, its socket closed
        return answer(self, frame, extra, received)

    monkeypatch.setattr(bound_ipc.IpcBoundSession, "_answer", misbehaving)
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = IpcTarget(tiny_root, "eagle3", drafter, seed=4)
        client = t.client
        try:
            client.bind()
            assert client.link.bell is not None
            n, b = _fill(client.views, t.s_remote.call(PLANS[0]).kwargs)
            client.timeout_s, mode["now"] = 0.5, "hang"
            with pytest.raises(DrafterError) as err:
                client.step(n, b, **PADDING)
            assert err.value.code == Code.DEADLINE_EXCEEDED, str(err.value)
            assert client.link is None, "a binding in doubt is dropped"
            gate.set()
            client.timeout_s, mode["now"] = 60, "gone"
            with pytest.raises(DrafterError) as err:  # binds again first (the last one was dropped)
                client.step(n, b, **PADDING)
            assert err.value.code == Code.FAILED_PRECONDITION and err.value.field == "session", str(err.value)
            with pytest.raises(DrafterError) as err:
                client.step(n, b, **PADDING)
            assert err.value.code == Code.UNAVAILABLE, str(err.value)
            mode["now"] = ""
            with pytest.raises(DrafterError) as err:
                client.step(n, b, **PADDING)
            assert err.value.code == Code.FAILED_PRECONDITION and err.value.field == "session", str(err.value)
            assert client.binds == 3 and client.link.bell is not None
            t.s_ref, t.s_remote = _scenario(t.ref, 5), _scenario(t.ref, 5)  # the target prefills again
            t.step(PLANS[0])
        finally:
            gate.set()
            client.close()


def test_a_target_that_goes_away_ends_the_bindings_doorbell_thread(tiny_root):
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = IpcTarget(tiny_root, "eagle3", drafter, seed=6)
        try:
            t.client.bind()
            binding = _binding(drafter, t)
            assert binding._bell_thread.is_alive()
            t.client.link.bell.close()  # as the target's process exit would
            binding._bell_thread.join(10)
            assert not binding._bell_thread.is_alive()
            assert not binding._stop.is_set(), "the binding itself lives on (its data socket, its session)"
        finally:
            t.client.close()


def test_nccl_channel_steps_over_the_doorbell_draft_what_in_process_drafts(tiny_root, monkeypatch):
    """The nccl_channel plane (its NCCL replaced by gloo, as tests/integration/test_bound_channel.py
    runs it) on one host: the header by the doorbell, the slab and the output down the channel."""
    from coordinator.transport import bound_channel as client_channel
    from drafter.service import bound_channel
    from drafter.wire import bound_channel as bc
    from tests.integration.test_bound_channel import ChannelTarget

    monkeypatch.setattr(bound_channel, "BACKEND", bc.GLOO)
    monkeypatch.setattr(client_channel, "BACKEND", bc.GLOO)
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = ChannelTarget(tiny_root, "eagle3", drafter, seed=7)
        try:
            t.step(PLANS[0])
            link = t.client.link
            assert t.client.plane == wb.NCCL_CHANNEL and link.bell is not None, link.bell_reason
            link.sock.close(linger=0)  # only the doorbell can carry the next header
            t.step(PLANS[1])
        finally:
            t.client.close()


def test_a_spin_past_the_drafters_limit_is_refused_naming_it(tiny_root):
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = IpcTarget(tiny_root, "eagle3", drafter, seed=8)
        t.client.spin_us = wb.MAX_SPIN_US + 1
        try:
            with pytest.raises(DrafterError) as err:
                t.client.bind()
            assert err.value.code == Code.INVALID_ARGUMENT and err.value.field == "spin_us", str(err.value)
            assert not drafter.core.sessions.sessions, "the refused bind gave its session back"
        finally:
            t.client.close()


def test_the_client_has_its_host_wait_where_the_drafter_shares_its_gpu(tiny_root, monkeypatch):
    """CudaIpcBoundClient(host_wait=None) asks coordinator.transport.bound_ipc.same_gpu at bind (here
    made to say yes: a CPU drafter advertises no GPU) and its link waits on the host."""
    from coordinator.transport import bound_ipc as client_ipc

    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = IpcTarget(tiny_root, "eagle3", drafter, seed=9)
        t.client.host_wait = None
        try:
            t.client.bind()
            assert not t.client.link.host_wait, "a CPU drafter shares no GPU"
            monkeypatch.setattr(client_ipc, "same_gpu", lambda support, device: True)
            t.client.bind()
            assert t.client.link.host_wait
        finally:
            t.client.close()
