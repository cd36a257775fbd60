"""The host ring's stream (drafter.wire.ring_stream, drafter.service.ring_stream): header and prefix
on one plain tcp or same-host UNIX connection, the prefix received in chunks straight into the ring.

A drafter service in this process (tests.integration.test_bound_remote.Drafter, graphs emulated on
CPU) serves HostRingClients.  Steps over the stream must draft what an in-process engine drafts,
with the ZMQ data socket closed under them (so the stream carried them), over tcp and ipc, on the
CPU drafter's session (checks on the host) and the GPU drafter's (bound_ipc.GuardedRingSession,
forced on CPU) with chunks small enough that a step lands in several, each staged as it lands;
every step is stamped in order on both sides; a client that asks for no stream steps on the data
socket, stamped too.  Messages the stream cannot take are refused naming the field before a byte
of their body is read (and close the stream), or are answered with the body drained (and the
stream goes on); a connection without the binding's hello is closed unanswered.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from tests.integration.test_bound_remote import PADDING, PLANS, Drafter, Target, _engine, _fill  # noqa: E402

from drafter.service import bound_ipc, ring_stream  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from drafter.wire import ring_stream as rs  # noqa: E402
from drafter.wire.errors import Code, DrafterError  # noqa: E402

ORDER = ["sent", "received", "landed", "started", "queued", "replied", "answered", "read"]  # and "pushed"
# between "sent" and "answered" (the drafter may have the last chunk before the sender returns)


def _binding(drafter, target: Target):
    return drafter.server._bound_plane.sessions[target.client.session.session_id]


def _in_order(stamps: dict, names: list[str]) -> None:
    assert [stamps[k] for k in names] == sorted(stamps[k] for k in names), stamps
    assert stamps["sent"] <= stamps["pushed"] <= stamps["answered"], stamps


@pytest.mark.parametrize("guarded,lanes", [(False, 1), (True, 4)], ids=["host-checks-1-lane", "gpu-guard-4-lanes"])
def test_steps_over_the_stream_draft_what_in_process_drafts(tiny_root, monkeypatch, guarded, lanes):
    monkeypatch.setattr(bound_ipc, "GUARDED_RING", guarded)
    for name in ("CHUNK", "SEND_BYTES", "RECV_BYTES"):  # a 13-token EAGLE-3 step's prefix in several pieces
        monkeypatch.setattr(rs, name, 2048)
    chunks, copies, busy = [], [], []  # busy: the chunk start whose landing finds the engine's lock taken
    if guarded:
        landed = ring_stream.GuardedStreamSession._landed
        monkeypatch.setattr(ring_stream.GuardedStreamSession, "_landed", lambda self, a, z: (
            chunks.append((a, z)), _busy(self.core.executor.engine_lock, landed, self, a, z) if a in busy
            else landed(self, a, z)))
    with Drafter(_engine(tiny_root, "eagle3"), ipc_path=None) as drafter:
        t = Target(tiny_root, "eagle3", drafter, seed=1, transport="tcp")
        t.client.lanes = lanes
        try:
            t.step(PLANS[0])
            b = _binding(drafter, t)
            assert type(b) is (ring_stream.GuardedStreamSession if guarded else ring_stream.RingStreamSession)
            link = t.client.link
            assert link.conn is not None and link.resp.stream.startswith("tcp://"), link.stream_reason
            assert len(link.conns) == lanes == b.stream_lanes
            link.sock.close(linger=0)  # the data socket gone: only the stream can carry the next step
            if guarded:  # the chunks the lanes could not stage (the engine busy) are copied at the step
                stage = ring_stream.GuardedStreamSession._stage
                monkeypatch.setattr(ring_stream.GuardedStreamSession, "_stage", lambda self, n: (
                    copies.append(list(self._staged)), stage(self, n)))
                busy.append(rs.CHUNK)
            chunks.clear()
            t.step(PLANS[1])
            _in_order(t.client.stamps, ORDER)
            if guarded:
                nbytes = wb.step_bytes(b.slots, 13)
                assert sorted(chunks) == [(a, min(nbytes, a + rs.CHUNK)) for a in range(0, nbytes, rs.CHUNK)]
                assert len(chunks) >= lanes, "every lane carried a stripe"
                assert rs.CHUNK not in [a for a, _ in copies[-1]] and 0 < len(copies[-1]) < len(chunks), \
                    "the chunk landed while the engine was busy (and any other then) was left to the step"
            assert t.client.binds == 1
        finally:
            t.close()


def _busy(lock, landed, session, a: int, z: int) -> None:
    """landed() while another thread holds the engine's lock (a replay, a capture)."""
    taken = threading.Event()
    done = threading.Event()

    def hold():
        with lock:
            taken.set()
            done.wait(10)
    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(10)
    try:
        landed(session, a, z)
    finally:
        done.set()
        holder.join(10)


def test_stripes_split_a_body_into_whole_chunks_lane_0_first():
    assert rs.stripes(0, 4, 8) == [(0, 0)] * 4
    assert rs.stripes(5, 4, 8) == [(0, 5), (5, 5), (5, 5), (5, 5)]
    assert rs.stripes(70, 4, 8) == [(0, 24), (24, 48), (48, 70), (70, 70)]
    assert rs.stripes(64, 2, 8) == [(0, 32), (32, 64)]
    for n in range(0, 200, 7):
        spans = rs.stripes(n, 3, 16)
        assert spans[0][0] == 0 and spans[-1][1] == n and all(a % 16 == 0 for a, z in spans if a < z)
        assert all(spans[i][1] == spans[i + 1][0] for i in range(2))


def test_over_ipc_and_without_a_stream(tiny_root, tmp_path, monkeypatch):
    """transport ipc: the stream is a same-host abstract UNIX name (4 lanes, the prefix in several
    chunks); stream=False: the data socket carries the steps as before, stamped."""
    for name in ("CHUNK", "SEND_BYTES", "RECV_BYTES"):
        monkeypatch.setattr(rs, name, 2048)
    with Drafter(_engine(tiny_root, "eagle3"), ipc_path=f"ipc://{tmp_path}/d.sock") as drafter:
        a = Target(tiny_root, "eagle3", drafter, seed=1, transport="ipc")
        b = Target(tiny_root, "eagle3", drafter, seed=2, transport="tcp")
        b.client.stream = False
        try:
            a.step(PLANS[0])
            b.step(PLANS[0])
            assert a.client.link.resp.stream.startswith(rs.UNIX_PREFIX) and len(a.client.link.conns) == 4
            assert b.client.link.conn is None and not b.client.link.resp.stream
            a.client.link.sock.close(linger=0)
            a.step(PLANS[1])
            b.step(PLANS[1])
            _in_order(b.client.stamps, ["sent", "received", "started", "queued", "replied", "answered", "read"])
        finally:
            a.close()
            b.close()


def _answer(conn) -> wb.StepDone:
    frame, _ = rs.read_message(conn, 1 << 16)
    return wb.DONE_DECODER.decode(frame)


def _rebound(t: Target) -> socket.socket:
    """The step after the drafter closed the stream fails and binds again (FAILED_PRECONDITION:
    resend the context); the new binding's stream (hello'd), for raw messages."""
    binds = t.client.binds
    n, nb = _fill(t.client.views, t.s_remote.call(PLANS[0]).kwargs)
    for _ in range(2):  # the first send may still be taken by the kernel: its reply is the close
        with pytest.raises(DrafterError) as err:
            t.client.step(n, nb, **PADDING)
        if err.value.code == Code.FAILED_PRECONDITION:
            break
    assert t.client.binds == binds + 1
    return t.client.link.conn


def test_messages_the_stream_cannot_take_are_refused_naming_the_field(tiny_root):
    """What a buggy or hostile target writes on its own stream: the drafter names the field."""
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = Target(tiny_root, "eagle3", drafter, seed=1)
        try:
            t.step(PLANS[0])
            bad, ring = t.client.link.conn, _binding(drafter, t).ring.numel()
            # a header that does not decode, then one whose nbytes is not the body's: answered, body drained
            rs.send_message(bad, b"\xc1 not a header", [bytes(100)])
            done = _answer(bad)
            assert (done.code, done.field) == (int(Code.INVALID_ARGUMENT), "header"), done
            head = wb.StepHeader(step=7, num_tokens=13, batch=3, nbytes=64, bind_id=t.client.link.resp.bind_id)
            rs.send_message(bad, wb.encode(head), [bytes(128)])
            done = _answer(bad)
            assert (done.step, done.code, done.field) == (7, int(Code.INVALID_ARGUMENT), "nbytes"), done
            t.step(PLANS[1])  # the stream goes on
            # a body past the ring: refused before a byte of it is read, and the stream closed
            bad.sendall(rs.PREFIX.pack(len(wb.encode(head)), ring + 1, rs.CHUNK) + wb.encode(head))
            done = _answer(bad)
            assert (done.code, done.field) == (int(Code.INVALID_ARGUMENT), "nbytes"), done
            with pytest.raises((rs.Closed, ConnectionError)):
                rs.read_message(bad, 0)
            # a head past MAX_HEAD on the next binding's stream: refused naming the header, closed
            bad = _rebound(t)
            bad.sendall(rs.PREFIX.pack(rs.MAX_HEAD + 1, 0, 0))
            done = _answer(bad)
            assert (done.code, done.field) == (int(Code.INVALID_ARGUMENT), "header"), done
            with pytest.raises((rs.Closed, ConnectionError)):
                rs.read_message(bad, 0)
            # a stripe unit that is not a power of two: the lanes' bytes cannot be placed, closed
            bad = _rebound(t)
            bad.sendall(rs.PREFIX.pack(len(wb.encode(head)), 64, 3000) + wb.encode(head))
            done = _answer(bad)
            assert (done.code, done.field) == (int(Code.INVALID_ARGUMENT), "unit"), done
        finally:
            t.close()
        many = Target(tiny_root, "eagle3", drafter, seed=2)
        many.client.lanes = rs.MAX_LANES + 1
        try:
            with pytest.raises(DrafterError) as err:
                many.client.bind()
            assert (err.value.code, err.value.field) == (Code.INVALID_ARGUMENT, "stream_lanes"), str(err.value)
        finally:
            many.close()


def test_a_connection_without_the_hello_is_closed_unanswered():
    listener, address = rs.listen("tcp", "127.0.0.1")
    family, where = rs._target(address)
    strangers = [socket.create_connection(where, timeout=10) for _ in range(2)]
    rs.send_message(strangers[0], rs.HELLO + b"0" * 32, [])
    strangers[1].sendall(rs.PREFIX.pack(1 << 30, 0, 0))
    good = []
    t = threading.Thread(target=lambda: good.extend(rs.connect(address, "f" * 32, 10, lane) for lane in (1, 0)))
    t.start()
    until = time.monotonic() + 30
    conns = rs.accept(listener, "f" * 32, lambda: time.monotonic() < until, 0.05, 2.0, lanes=2)
    t.join(10)
    try:
        assert conns is not None and len(good) == 2
        assert [c.getpeername() for c in conns] == [good[1].getsockname(), good[0].getsockname()], "in lane order"
        for s in strangers:
            with pytest.raises((rs.Closed, ConnectionError)):
                rs.read_message(s, 0)
    finally:
        for s in (*strangers, *good, *(conns or ()), listener):
            s.close()


def test_a_stream_the_drafter_closed_fails_the_step_and_the_client_binds_again(tiny_root):
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = Target(tiny_root, "eagle3", drafter, seed=1)
        try:
            t.step(PLANS[0])
            b = _binding(drafter, t)
            b.stop()  # the binding ends on the drafter's side (as a detach or a new Bind ends it)
            b.join()
            n, nb = _fill(t.client.views, t.s_remote.call(PLANS[1]).kwargs)
            with pytest.raises(DrafterError) as err:
                t.client.step(n, nb, **PADDING)
            assert err.value.code in (Code.UNAVAILABLE, Code.FAILED_PRECONDITION), str(err.value)
            assert not t.client.link.alive or t.client.binds == 2
        finally:
            t.close()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "data-socket"])
def test_the_cuda_ipc_clients_ring_fallback_stamps_every_stage_the_bench_reads(tiny_root, stream):
    """CudaIpcBoundClient forced onto the host ring with its ring client made first, as
    coordinator.bench.bound opens host_ring and host_ring_zmq: it drafts what in-process drafts and
    its ring's stamps cover every RING_STAGES point."""
    from coordinator.bench.bound import RING_STAGES
    from coordinator.transport.bound_client import HostRingClient
    from coordinator.transport.bound_ipc import CudaIpcBoundClient
    from drafter.wire.cuda_slab import LocalSlabs
    from tests.integration.test_bound_remote import MAX_BATCH, _buffers

    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        ref = Target(tiny_root, "eagle3", drafter, seed=1)  # its reference engine and scenario drive the client
        shape = Target._layout(drafter)
        client = CudaIpcBoundClient(drafter.endpoint, shape, _buffers(drafter.engine), max_batch=MAX_BATCH,
                                    device="cpu", timeout_s=60, allow_fallback=False, force_ring=True,
                                    slabs=LocalSlabs())
        client.ring = HostRingClient(drafter.endpoint, shape, client.buffers, max_batch=MAX_BATCH, timeout_s=60,
                                     stream=stream)
        try:
            assert client.bind() == wb.HOST_RING
            assert (client.ring.link.conn is not None) == stream
            for plan in PLANS:
                expected = ref.ref.propose(**ref.s_ref.call(plan).kwargs).draft_token_ids
                n, b = _fill(client.views, ref.s_remote.call(plan).kwargs)
                assert torch.equal(client.step(n, b, **PADDING), expected)
            stamps = client.ring.stamps
            assert all(k in stamps for _, a, z in RING_STAGES for k in (a, z)), sorted(stamps)
        finally:
            client.detach()
            client.close()
            ref.close()


def test_staging_at_the_step_copies_the_prefix_once_and_drafts_the_same(tiny_root, monkeypatch):
    """BindRequest.stream_staging "step": the GPU session (forced on CPU) queues no copy as the spans
    land and copies the prefix whole at the step; a staging it does not know is refused naming it."""
    monkeypatch.setattr(bound_ipc, "GUARDED_RING", True)
    for name in ("CHUNK", "SEND_BYTES", "RECV_BYTES"):
        monkeypatch.setattr(rs, name, 2048)
    landed, staged = [], []
    real_landed, real_stage = ring_stream.GuardedStreamSession._landed, ring_stream.GuardedStreamSession._stage
    monkeypatch.setattr(ring_stream.GuardedStreamSession, "_landed",
                        lambda self, a, z: (landed.append((a, z)), real_landed(self, a, z)))
    monkeypatch.setattr(ring_stream.GuardedStreamSession, "_stage",
                        lambda self, n: (staged.append(list(self._staged)), real_stage(self, n)))
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = Target(tiny_root, "eagle3", drafter, seed=1)
        t.client.staging = "step"
        odd = Target(tiny_root, "eagle3", drafter, seed=2)
        odd.client.staging = "later"
        try:
            t.step(PLANS[0])
            t.step(PLANS[1])
            assert _binding(drafter, t)._per_span is False
            assert landed == [] and staged == [[], []], "nothing staged as it landed: one copy at each step"
            with pytest.raises(DrafterError) as err:
                odd.client.bind()
            assert (err.value.code, err.value.field) == (Code.INVALID_ARGUMENT, "stream_staging"), str(err.value)
        finally:
            t.close()
            odd.close()
