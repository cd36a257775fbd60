"""The host ring's stream (drafter.wire.ring_stream, drafter.service.ring_stream): header and prefix
on plain tcp or same-host UNIX connections (lanes), the prefix striped over them and received in
pieces straight into the ring, a thread per lane past the first.

A drafter service in this process (tests.integration.test_bound_remote.Drafter, graphs emulated on
CPU) serves HostRingClients.  Steps over the stream must draft what an in-process engine drafts,
with the ZMQ data socket closed under them (so the stream carried them), over tcp and ipc, on the
CPU drafter's session (checks on the host) and the GPU drafter's (bound_ipc.GuardedRingSession,
forced on CPU) with chunks small enough that a step lands in several, each staged as it lands;
every step is stamped in order on both sides; striped steps draft what one lane drafts; a client
that asks for no stream steps on the data socket, stamped too.  Messages the stream cannot take
are refused naming the field before a byte of their body is read (and close the stream), or are
answered with the body drained (and the stream goes on); a lane that lies about its stripe, or
dies, or stays silent fails the step naming "lane" while another target's steps go on; a
connection without the binding's hello is closed unanswered.
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
    _small_pieces(monkeypatch)
    chunks, copies, busy = [], [], []  # busy: the chunk start whose landing finds the engine's lock taken
    if guarded:
        landed = ring_stream.GuardedStreamSession._landed
        monkeypatch.setattr(ring_stream.GuardedStreamSession, "_landed", lambda self, a, z: (
            chunks.append((a, z)), _busy(self.core.executor.engine_lock, landed, self, a, z) if a in busy
            else landed(self, a, z)))
    with Drafter(_engine(tiny_root, "eagle3"), ipc_path=None) as drafter:
        t = Target(tiny_root, "eagle3", drafter, seed=1, transport="tcp")
        t.client.lanes, t.client.lane_bytes = lanes, 0  # every lane that gets a piece
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
                got = sorted(chunks)
                assert got[0][0] == 0 and got[-1][1] == nbytes and all(
                    x[1] == y[0] for x, y in zip(got, got[1:])), "the pieces landed tile the prefix"
                assert all(z - a <= rs.RECV_BYTES for a, z in got)
                stripes = rs.plan(nbytes, lanes)
                assert len(stripes) == lanes and {a for a, _ in stripes} <= {a for a, _ in got}, \
                    "every lane carried a stripe"
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


def _small_pieces(monkeypatch, size: int = 2048) -> None:
    """A 13-token EAGLE-3 step's prefix (11 KB) in several pieces, striped over up to four lanes."""
    for name in ("CHUNK", "SEND_BYTES", "RECV_BYTES"):
        monkeypatch.setattr(rs, name, size)
    monkeypatch.setattr(rs, "ALIGN", size // 4)


def test_plan_stripes_a_body_lane_0_first_on_as_many_lanes_as_get_lane_bytes(monkeypatch):
    monkeypatch.setattr(rs, "CHUNK", 16)
    monkeypatch.setattr(rs, "ALIGN", 8)
    assert rs.plan(0, 4) == [(0, 0)]
    assert rs.plan(5, 4) == [(0, 5)], "under CHUNK: lane 0 alone"
    assert rs.plan(70, 4) == [(0, 24), (24, 48), (48, 70)], "CHUNK per lane at least: 4 lanes would get 17.5"
    assert rs.plan(64, 2) == [(0, 32), (32, 64)]
    assert rs.plan(64, 4, lane_bytes=32) == [(0, 32), (32, 64)]
    assert rs.plan(63, 4, lane_bytes=32) == [(0, 63)]
    for n in range(0, 400, 7):
        for lanes, least in ((3, 0), (8, 0), (4, 40)):
            spans = rs.plan(n, lanes, least)
            assert spans[0][0] == 0 and spans[-1][1] == n and all(a % 8 == 0 for a, z in spans)
            assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
            assert len(spans) <= lanes and all(a < z for a, z in spans[1:])
            assert len(spans) == 1 or all(z - a >= max(least, 16) - 8 for a, z in spans[:-1])


def test_striped_steps_draft_what_one_lane_and_in_process_draft(tiny_root, monkeypatch):
    """The same steps on one lane and striped over four (each lane a stripe): both equal the
    in-process engine's drafts (Target.step), the striped one carried by four lanes; the one-lane
    client polls for its replies (reply_spin_us) and finds each while polling."""
    _small_pieces(monkeypatch)
    spun, spin = [], rs.spin_readable
    monkeypatch.setattr(rs, "spin_readable", lambda sock, s: spun.append(spin(sock, s)) or spun[-1])
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        one = Target(tiny_root, "eagle3", drafter, seed=3)
        four = Target(tiny_root, "eagle3", drafter, seed=3)
        one.client.lanes, four.client.lanes, four.client.lane_bytes = 1, 4, 0
        one.client.reply_spin_us = 30_000_000  # the CPU engine's step, whatever this host's load
        sent = []
        try:
            for plan in PLANS:
                one.step(plan)
                real = rs.send_stripes
                with monkeypatch.context() as m:
                    m.setattr(rs, "send_stripes", lambda conns, spans, *a, **k: (sent.append(spans),
                                                                                  real(conns, spans, *a, **k)))
                    four.step(plan)
            assert all(len(spans) == 4 for spans in sent), sent
            assert spun == [True] * len(PLANS), spun
        finally:
            one.close()
            four.close()


def test_over_ipc_and_without_a_stream(tiny_root, tmp_path, monkeypatch):
    """transport ipc: the stream is a same-host abstract UNIX name (4 lanes, the prefix in several
    pieces); stream=False: the data socket carries the steps as before, stamped."""
    _small_pieces(monkeypatch)
    with Drafter(_engine(tiny_root, "eagle3"), ipc_path=f"ipc://{tmp_path}/d.sock") as drafter:
        a = Target(tiny_root, "eagle3", drafter, seed=1, transport="ipc")
        b = Target(tiny_root, "eagle3", drafter, seed=2, transport="tcp")
        a.client.lane_bytes = 0
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


def _rebound(t: Target) -> list[socket.socket]:
    """The step after the drafter closed the stream fails and binds again (FAILED_PRECONDITION:
    resend the context); the new binding's lanes (hello'd), for raw messages."""
    binds = t.client.binds
    n, nb = _fill(t.client.views, t.s_remote.call(PLANS[0]).kwargs)
    for _ in range(2):  # the first send may still be taken by the kernel: its reply is the close
        with pytest.raises(DrafterError) as err:
            t.client.step(n, nb, **PADDING)
        if err.value.code == Code.FAILED_PRECONDITION:
            break
    assert t.client.binds == binds + 1
    return t.client.link.conns


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
            bad.sendall(rs.PREFIX.pack(len(wb.encode(head)), ring + 1, 1) + wb.encode(head))
            done = _answer(bad)
            assert (done.code, done.field) == (int(Code.INVALID_ARGUMENT), "nbytes"), done
            with pytest.raises((rs.Closed, ConnectionError)):
                rs.read_message(bad, 0)
            # a head past MAX_HEAD on the next binding's stream: refused naming the header, closed
            bad = _rebound(t)[0]
            bad.sendall(rs.PREFIX.pack(rs.MAX_HEAD + 1, 0, 0))
            done = _answer(bad)
            assert (done.code, done.field) == (int(Code.INVALID_ARGUMENT), "header"), done
            with pytest.raises((rs.Closed, ConnectionError)):
                rs.read_message(bad, 0)
            # more lanes than the binding has: the lanes' bytes cannot be placed, closed
            bad = _rebound(t)[0]
            bad.sendall(rs.PREFIX.pack(len(wb.encode(head)), 64, t.client.lanes + 1) + wb.encode(head))
            done = _answer(bad)
            assert (done.code, done.field) == (int(Code.INVALID_ARGUMENT), "lanes"), done
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


def _raw(conns: list, head: wb.StepHeader, lanes: list[tuple[int, int, int, int]], used: int) -> None:
    """A message written by hand: the head on lane 0 (`used` lanes in its PREFIX), then lane i's
    LANE record (step, start, size) and `sent` zero bytes of its stripe, for (step, start, size,
    sent) in lanes."""
    frame = wb.encode(head)
    conns[0].sendall(rs.PREFIX.pack(len(frame), head.nbytes, used) + frame)
    for conn, (seq, start, size, sent) in zip(conns, lanes):
        conn.sendall(rs.LANE.pack(seq, start, size) + bytes(sent))


def test_a_lane_that_lies_about_its_stripe_or_dies_fails_the_step_naming_it(tiny_root, monkeypatch):
    """Three lanes, the step's prefix in three stripes.  A lane whose stripe leaves the ring is
    refused before a byte of it is read; stripes that overlap, leave a gap or run past the body, and
    a lane of another step, are refused naming "lane" (the stream closed where the bytes cannot be
    placed, answered and open where they can); a lane that closes or stays silent fails the step
    UNAVAILABLE naming "lane", never hangs it.  Another target's steps draft as before throughout."""
    _small_pieces(monkeypatch)
    monkeypatch.setattr(ring_stream, "IO_TIMEOUT_S", 0.5)
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        t = Target(tiny_root, "eagle3", drafter, seed=1)
        other = Target(tiny_root, "eagle3", drafter, seed=2)
        t.client.lanes, t.client.lane_bytes = 3, 0
        try:
            t.step(PLANS[0])
            other.step(PLANS[0])
            b = _binding(drafter, t)
            n = wb.step_bytes(b.slots, 13)
            (a0, z0), (a1, z1), (a2, z2) = rs.plan(n, 3)
            # (lane records, code, whether the stream stays open); lane 2 closes at the 6th, is silent at the 7th
            cases = [
                ([(8, a0, z0, z0), (8, a1, z1 - a1, z1 - a1), (8, a2, z2 - a2, z2 - a2)],
                 Code.INVALID_ARGUMENT, True),  # every lane of another step than the header's
                ([(9, a0, z0, z0), (9, a1, b.ring.numel(), 0), (9, a2, z2 - a2, z2 - a2)],
                 Code.INVALID_ARGUMENT, False),  # lane 1's stripe past the ring
                ([(9, a0, z0, z0), (9, a1, z1 - a1 + 64, z1 - a1 + 64), (9, a2, z2 - a2, z2 - a2)],
                 Code.INVALID_ARGUMENT, False),  # lane 1 sends more than its share: overlaps lane 2
                ([(9, a0, z0, z0), (9, a1, z1 - a1 - 64, z1 - a1 - 64), (9, a2, z2 - a2, z2 - a2)],
                 Code.INVALID_ARGUMENT, False),  # less: a gap
                ([(9, a0, z0, z0), (9, a1, z1 - a1, z1 - a1), (8, a2, z2 - a2, z2 - a2)],
                 Code.INVALID_ARGUMENT, False),  # lane 2 of another step
                ([(9, a0, z0, z0), (9, a1, z1 - a1, z1 - a1)], None, False),
                ([(9, a0, z0, z0), (9, a1, z1 - a1, z1 - a1)], None, False),
            ]
            conns = t.client.link.conns
            for i, (lanes, code, stays) in enumerate(cases):
                if i == 5:
                    conns[2].close()
                started = time.monotonic()
                head = wb.StepHeader(step=9, num_tokens=13, batch=3, nbytes=n, bind_id=t.client.link.resp.bind_id,
                                     **PADDING)
                _raw(conns, head, lanes, 3)
                done = _answer(conns[0])
                expect = Code.UNAVAILABLE if code is None else code
                assert (done.code, done.field) == (int(expect), "lane"), (i, done)
                assert time.monotonic() - started < 20, "the step failed, not hung"
                if stays:
                    t.step(PLANS[1])  # answered: the stream goes on (first: t's history is the drafter's)
                else:
                    with pytest.raises((rs.Closed, ConnectionError)):
                        rs.read_message(conns[0], 0)
                    t.client.detach()  # its blocks back to the pool: the drafter holds a few sessions
                    t.client.bind()
                    conns = t.client.link.conns
                if i in (2, len(cases) - 1):  # its history is short: a step now and then
                    other.step(PLANS[1])
        finally:
            t.close()
            other.close()


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
