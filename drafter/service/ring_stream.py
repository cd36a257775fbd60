"""Host-ring sessions with the ring stream beside their data socket, and the plane's stamps.

    Bind (plane "host_ring", BindRequest.stream): a listener for the binding (drafter.wire.
        ring_stream: tcp on the server's host, or a same-host abstract UNIX name for transport
        "ipc"); its address goes back in BindResponse.stream.  The ZMQ data socket stays open beside it.
    the stream's threads: the target's connections, one per lane (BindRequest.stream_lanes; each
    hello the bind id and its lane); a thread per lane past the first, blocked on its connection,
    each stripe received straight into the pinned ring as it comes (ring_stream.Lanes: its LANE
    record checked against the ring before a byte of it is read); then on lane 0, each step:
        PREFIX read and bounded (the head <= MAX_HEAD, the body <= the ring, the lanes used <= the
            binding's) before anything else
        the StepHeader read; its nbytes must equal the body's length ("nbytes")
        lane 0's stripe received; the lanes' stripes must tile the body, all of this step ("lane")
            (ring_stream.receive_body); on a GPU drafter each piece's host-to-device copy is queued
            as it lands, on whichever lane's thread (under the engine's lock, taken without
            waiting: a piece it cannot take now is copied with the rest at the step)
        the step as on the data socket (admit, run_step: the sizes, the GPU guard, the replay)
        [StepDone (stamped), drafts]
    A message the stream cannot take (a head too long, a body past the ring, stripes that do not
    tile it) is answered INVALID_ARGUMENT naming the field ("header", "nbytes", "lanes", "lane")
    and the connections are closed (their bytes cannot be told apart from the next message's); a
    lane that closed, failed or stayed silent for IO_TIMEOUT_S is answered UNAVAILABLE naming
    "lane", the connections closed; a header that does not decode or whose nbytes is not the
    body's is answered so with its body drained into the ring, and the stream goes on.

The stream is not authenticated beyond its hello's bind id: while the server requires auth, a Bind
for it over tcp is refused before it is built (BoundPlane.check_authenticated, field "stream", unless
--insecure-bound-planes); over ipc it is a same-host abstract name and is served.

Every host-ring step of these sessions, on the stream or the data socket, is stamped with the
drafter's perf_counter_ns (StepDone.stamps: wb.STAMPS then wb.RING_STAMPS) for the bench's breakdown.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from drafter.service.bound_ipc import GuardedRingSession, ring_session_class as guarded_class
from drafter.service.bound_sessions import POLL_MS, BoundSession
from drafter.wire import bound as wb
from drafter.wire import ring_stream as rs
from drafter.wire.errors import Code, DrafterError, invalid

log = logging.getLogger("drafter.service.bound")

HELLO_TIMEOUT_S = 2.0  # a stream connection that sends no hello in this time is closed
IO_TIMEOUT_S = 30.0  # a peer that stops inside a message this long loses the connection


class _Stream:
    """The ring stream of one host-ring binding (a mixin over BoundSession or GuardedRingSession)."""

    def _link_state(self, req: wb.BindRequest) -> None:
        if not 0 <= req.stream_lanes <= rs.MAX_LANES:
            raise invalid("stream_lanes", f"{req.stream_lanes} must lie in [0, {rs.MAX_LANES}]")
        if req.stream_staging not in wb.STAGINGS:
            raise invalid("stream_staging", f"{req.stream_staging!r}: one of {list(wb.STAGINGS)}")
        super()._link_state(req)
        self._started = self._queued = 0  # the running step's stamps (perf_counter_ns)
        self._staged: list[tuple[int, int]] = []  # the next step's spans already queued to the GPU slab
        self._lane_lock = threading.Lock()  # the lanes queue their pieces' copies one at a time
        self.stream_lanes = max(1, req.stream_lanes)
        self._per_span = req.stream_staging == "span"  # the GPU session's copies as spans land (else at the step)
        self._stream_listener, self.stream_address, self._stream_thread = None, "", None
        self._lanes = None  # ring_stream.Lanes: the threads of the lanes past the first, once connected
        if not req.stream:
            return
        try:
            self._stream_listener, self.stream_address = rs.listen(req.transport, self.plane.server.host)
        except OSError as exc:
            log.info("no ring stream for the binding: %s", exc, extra={"event": "bind_stream_unavailable"})

    def open(self, ctx, endpoint: str) -> None:
        try:
            super().open(ctx, endpoint)
        except BaseException:  # the Bind fails: its listener goes with it
            if self._stream_listener is not None:
                self._stream_listener.close()
            raise
        if self._stream_listener is not None:
            self._stream_thread = threading.Thread(target=self._serve_stream, name=f"ring-{self.bind_id[:8]}",
                                                   daemon=True)
            self._stream_thread.start()

    def join(self, timeout_s: float = 10.0) -> None:
        super().join(timeout_s)
        if self._stream_thread is not None:
            self._stream_thread.join(timeout_s)
        if self._lanes is not None:
            self._lanes.join(timeout_s)

    # ------------------------------------------------------------------ the stream's thread
    def _serve_stream(self) -> None:
        """The stream's thread: its lanes' connections, a thread per lane past the first, then the
        steps on lane 0 until the binding ends or the target hangs up."""
        listener, conns, lanes = self._stream_listener, None, None
        try:
            conns = rs.accept(listener, self.bind_id, self._alive, POLL_MS / 1e3, HELLO_TIMEOUT_S, self.stream_lanes)
            listener.close()
            if conns is None:
                return
            device = getattr(self, "device", None)
            _on_device(device)  # the pieces' copies queue on this thread's current device
            for conn in conns:
                rs.hold_timeout(conn, IO_TIMEOUT_S)
            ring = memoryview(self.ring.numpy())
            staging = self._landed if self._per_span else None
            if len(conns) > 1:
                lanes = self._lanes = rs.Lanes(conns, ring, staging, self._alive, POLL_MS / 1e3,
                                               lambda: _on_device(device)).start()
            while self._alive():
                if not rs.wait_readable(conns[0], POLL_MS / 1e3):
                    continue
                if not self._stream_step(conns[0], ring, lanes, staging):
                    return
        except (OSError, rs.Closed) as exc:
            log.debug("ring stream ended: %s", exc)
        except Exception:  # noqa: BLE001 - a copy failed (a bug of ours): the stream ends, the drafter serves on
            log.exception("ring stream failed", extra={"event": "bound_stream_failed"})
        finally:
            listener.close()
            for conn in conns or ():
                conn.close()

    def _stream_step(self, conn, ring: memoryview, lanes, staging) -> bool:
        """One message in, its answer out; False where the connections cannot go on."""
        received = time.perf_counter_ns()
        self._accepted = []
        self._started, self._queued = 0, 0
        try:
            head_len, body_len, used = rs.read_prefix(conn, rs.MAX_HEAD, len(ring), self.stream_lanes)
            head, refused = self._decode(rs.read_exact(conn, head_len), body_len)
            seq = rs.receive_body(conn, ring, body_len, used, lanes, staging, IO_TIMEOUT_S, self._alive,
                                  POLL_MS / 1e3)
        except rs.FrameError as exc:
            return self._close_with(conn, Code.INVALID_ARGUMENT, exc.field, str(exc))
        except rs.LaneLost as exc:
            return self._close_with(conn, Code.UNAVAILABLE, "lane", str(exc))
        landed = time.perf_counter_ns()
        if refused is None and seq is not None and seq != head.step:
            refused = self._refused(head, DrafterError(
                Code.INVALID_ARGUMENT, "lane", f"the lanes carried step {seq}'s stripes for step {head.step}"))
        if refused is None:
            refused, payload = self._run_received(head, body_len)
        if refused is not None:
            self._forget_staged()
            rs.send_message(conn, wb.encode(refused), [])
            return True
        done = wb.StepDone(step=head.step, stamps=[received, self._started, self._queued, time.perf_counter_ns(),
                                                   landed])
        rs.send_message(conn, wb.encode(done), [payload])
        if self._accepted:  # after the reply: off the step's path
            self.core.metrics.record_acceptance(torch.tensor(self._accepted), self.core.desc.num_speculative_tokens)
        return True

    def _close_with(self, conn, code: Code, field: str, message: str) -> bool:
        """Answer a message whose bytes cannot be framed, before the connections close: False."""
        rs.send_message(conn, wb.encode(wb.StepDone(step=0, code=int(code), field=field,
                                                    message=f"{message}; the ring stream is closed")), [])
        return False

    def _forget_staged(self) -> None:
        """A refused step's pieces staged as they landed are no longer the ring's (the GPU session)."""

    def _decode(self, frame: bytes, body_len: int) -> tuple[wb.StepHeader | None, wb.StepDone | None]:
        """The header, or the refusal to answer (its body is drained into the ring meanwhile)."""
        try:
            head = wb.STEP_DECODER.decode(frame)
        except Exception as exc:  # noqa: BLE001 - msgspec's errors name the path
            return None, wb.StepDone(step=0, code=int(Code.INVALID_ARGUMENT), field="header", message=str(exc))
        if head.nbytes != body_len:
            return head, self._refused(head, DrafterError(
                Code.INVALID_ARGUMENT, "nbytes", f"the header says {head.nbytes} bytes, {body_len} followed"))
        return head, None

    def _run_received(self, head: wb.StepHeader, nbytes: int) -> tuple[wb.StepDone | None, bytes]:
        """The step whose prefix is in the ring: (None, drafts) or (its refusal, b"")."""
        try:
            self.admit(head)
            return None, self.run_step(head, nbytes)
        except DrafterError as exc:
            self._accepted = []
            return self._refused(head, exc), b""
        except Exception as exc:  # noqa: BLE001 - a bug of ours: the step still gets its answer
            log.exception("ring stream step failed")
            self._accepted = []
            return wb.StepDone(step=head.step, code=int(Code.INTERNAL), message=repr(exc)[:2000]), b""

    def _landed(self, start: int, end: int) -> None:
        """A chunk of the prefix is whole in the ring (the stream): nothing here, the engine's views
        are the ring's (the GPU session queues its copy)."""

    # ------------------------------------------------------------------ stamps (either socket)
    def _receive_and_run(self, sock, ring):
        received = time.perf_counter_ns()
        self._staged, self._started, self._queued = [], 0, 0
        done, payload = super()._receive_and_run(sock, ring)
        if not done.code:
            done.stamps = [received, self._started, self._queued, time.perf_counter_ns(), received]
        return done, payload

    def step(self, head: wb.StepHeader, nbytes: int) -> bytes:
        self._started = time.perf_counter_ns()
        out = super().step(head, nbytes)
        self._queued = self._queued or time.perf_counter_ns()  # the CPU engine: its work done
        return out


class RingStreamSession(_Stream, BoundSession):
    """The CPU drafter's host-ring session (its checks on the host) with the ring stream."""


class GuardedStreamSession(_Stream, GuardedRingSession):
    """The GPU drafter's host-ring session (the guard on the GPU) with the ring stream: each chunk's
    copy to the GPU slab queued as it lands."""

    def _landed(self, start: int, end: int) -> None:
        """Queue the span's copy to the slab where the engine's lock is free (a copy must not be
        queued while another thread captures a graph, nor while this session's step runs); else the
        step copies it.  The lanes take turns (_lane_lock: each holds it for the few microseconds
        of queueing one copy)."""
        lock = getattr(self.core.executor, "engine_lock", None)
        with self._lane_lock:
            if lock is not None and not lock.acquire(blocking=False):
                return
            try:
                self.slab[start:end].copy_(self.ring[start:end], non_blocking=True)
                self._staged.append((start, end))
            finally:
                if lock is not None:
                    lock.release()

    def _forget_staged(self) -> None:
        with self._lane_lock:
            self._staged = []

    def _stage(self, nbytes: int) -> None:
        """The parts of the prefix the lanes did not queue (all of it on the data socket), one copy per gap."""
        with self._lane_lock:
            staged, self._staged = sorted(self._staged), []
        at = 0
        for a, z in staged + [(nbytes, nbytes)]:
            if a > at:
                self.slab[at:min(a, nbytes)].copy_(self.ring[at:min(a, nbytes)], non_blocking=True)
            at = max(at, z)

    def _replay(self, head: wb.StepHeader) -> None:
        super()._replay(head)
        self._queued = time.perf_counter_ns()


def _on_device(device) -> None:
    """A lane thread's current device: the engine's, where the chunks' copies queue."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def ring_session_class(engine) -> type:
    """The host ring's session class for this engine: the GPU guard where the engine is on a GPU
    (or as bound_ipc.GUARDED_RING says), else the host's checks; both with the ring stream."""
    return GuardedStreamSession if guarded_class(engine) is not None else RingStreamSession
