"""Host-ring sessions with the ring stream beside their data socket, and the plane's stamps.

    Bind (plane "host_ring", BindRequest.stream): a listener for the binding (drafter.wire.
        ring_stream: tcp on the server's host, or a same-host abstract UNIX name for transport
        "ipc"); its address goes back in BindResponse.stream.  The ZMQ data socket stays open beside it.
    the stream's thread: the target's connections, one per lane (BindRequest.stream_lanes; each
    hello the bind id and its lane), then each step:
        PREFIX read from lane 0 and bounded (the head <= MAX_HEAD, the body <= the ring) before
            anything else
        the StepHeader read; its nbytes must equal the body's length ("nbytes")
        the body received chunk by chunk straight into the pinned ring, each lane's stripe
            (ring_stream.stripes) from its own connection by a thread of its own; on a GPU drafter
            each chunk's host-to-device copy is queued as it lands (under the engine's lock, taken
            without waiting: a chunk it cannot take now is copied with the rest at the step)
        the step as on the data socket (admit, run_step: the sizes, the GPU guard, the replay)
        [StepDone (stamped), drafts]
    A message the stream cannot take (a head too long, a body past the ring) is answered
    INVALID_ARGUMENT naming the field and the connection is closed (its bytes cannot be told apart
    from the next message's); a header that does not decode or whose nbytes is not the body's is
    answered so with its body drained into the ring, and the stream goes on.

Every host-ring step of these sessions, on the stream or the data socket, is stamped with the
drafter's perf_counter_ns (StepDone.stamps: wb.STAMPS then wb.RING_STAMPS) for the bench's breakdown.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

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
        self._staged: list[tuple[int, int]] = []  # the running step's spans already queued to the GPU slab
        self._lane_lock = threading.Lock()  # the lanes queue their chunks' copies one at a time
        self.stream_lanes = max(1, req.stream_lanes)
        self._per_span = req.stream_staging == "span"  # the GPU session's copies as spans land (else at the step)
        self._stream_listener, self.stream_address, self._stream_thread = None, "", None
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

    # ------------------------------------------------------------------ the stream's thread
    def _serve_stream(self) -> None:
        """The stream's thread: its lanes' connections, then their steps until the binding ends or
        the target hangs up (lanes past the first are received by a pool of their own)."""
        listener, conns, pool = self._stream_listener, None, None
        try:
            conns = rs.accept(listener, self.bind_id, self._alive, POLL_MS / 1e3, HELLO_TIMEOUT_S, self.stream_lanes)
            listener.close()
            if conns is None:
                return
            device = getattr(self, "device", None)
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)  # the chunks' copies queue on this thread's current device
            for conn in conns:
                rs.hold_timeout(conn, IO_TIMEOUT_S)
            if len(conns) > 1:
                pool = ThreadPoolExecutor(len(conns) - 1, thread_name_prefix=f"lane-{self.bind_id[:8]}",
                                          initializer=_on_device, initargs=(device,))
            ring = memoryview(self.ring.numpy())
            while self._alive():
                if not rs.wait_readable(conns[0], POLL_MS / 1e3):
                    continue
                if not self._stream_step(conns, ring, pool):
                    return
        except (OSError, rs.Closed) as exc:
            log.debug("ring stream ended: %s", exc)
        except Exception:  # noqa: BLE001 - a chunk's copy failed (a bug of ours): the stream ends, the drafter serves on
            log.exception("ring stream failed", extra={"event": "bound_stream_failed"})
        finally:
            listener.close()
            for conn in conns or ():
                conn.close()
            if pool is not None:
                pool.shutdown(wait=False)

    def _stream_step(self, conns: list, ring: memoryview, pool) -> bool:
        """One message in, its answer out; False where the connections cannot go on."""
        conn = conns[0]
        received = time.perf_counter_ns()
        self._accepted = []
        try:
            head_len, body_len, unit = rs.read_prefix(conn, rs.MAX_HEAD, len(ring))
        except rs.FrameError as exc:
            rs.send_message(conn, wb.encode(wb.StepDone(step=0, code=int(Code.INVALID_ARGUMENT), field=exc.field,
                                                        message=f"{exc}; the ring stream is closed")), [])
            return False
        frame = rs.read_exact(conn, head_len)
        head, refused = self._decode(frame, body_len)
        self._staged, self._started, self._queued = [], 0, 0
        staging = self._landed if refused is None and self._per_span else None
        rs.receive_striped(conns, ring, body_len, unit, staging, pool)
        landed = time.perf_counter_ns()
        if refused is None:
            refused, payload = self._run_received(head, body_len)
        if refused is not None:
            rs.send_message(conn, wb.encode(refused), [])
            return True
        done = wb.StepDone(step=head.step, stamps=[received, self._started, self._queued, time.perf_counter_ns(),
                                                   landed])
        rs.send_message(conn, wb.encode(done), [payload])
        if self._accepted:  # after the reply: off the step's path
            self.core.metrics.record_acceptance(torch.tensor(self._accepted), self.core.desc.num_speculative_tokens)
        return True

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
        queued while another thread captures a graph); else the step copies it.  The lanes take
        turns (_lane_lock: each holds it for the few microseconds of queueing one copy)."""
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

    def _stage(self, nbytes: int) -> None:
        """The parts of the prefix the lanes did not queue (all of it on the data socket), one copy per gap."""
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
