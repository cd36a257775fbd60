"""Bound sessions on the cuda_ipc plane: the target's slab opened once, no bytes per step.

    Bind (plane "cuda_ipc", drafter.service.bound_sessions dispatches here):
        the slab's reference checked (drafter.wire.cuda_slab) and opened on the engine's GPU ONCE
        the target's "inputs ready" event opened, this binding's "drafts ready" event created
        the step guard (drafter.engine.step_guard) over views of the slab
        the engine bound ONCE: the guard's outputs, the slab's hidden states in place, the drafts
            at the start of this binding's output buffer, which is shared back with the event;
            the guard folded into the binding's graphs (captured once: BoundPropose.fold)
    each step ([identity, StepHeader] on the session's data socket), on the data thread holding the
    engine's lock (EngineThread.engine_lock: no hop to the engine thread and back; an executor
    without that lock gets the step submitted instead):
        the sizes checked on the host
        the stream waits for the target's event (no host sync)
        bound.propose: the header's sizes stored, ONE replay (drafter.engine.bound.fold): the guard's
            launches first (every field checked and masked on the GPU, the error word into the
            output), then the engine's graphs (drafts into the output)
        the "drafts ready" event recorded; [identity, StepDone] at once (no host read), stamped
        with the drafter's perf_counter_ns at wb.STAMPS' and wb.FINE_STAMPS' points (the bench's
        breakdown)
    where the Bind asked for it (BindRequest.doorbell), the same step arrives instead on the
    binding's doorbell (drafter.wire.doorbell: a UNIX-domain SEQPACKET connection the target makes
    after the Bind, its hello the bind id), served by a second thread of the binding: the target's
    send wakes that thread directly, where a ZMQ frame passes two I/O threads first.  The data
    socket stays open beside it (a target that could not reach the doorbell steps there).  A
    Bind's spin_us has the thread poll that long after each reply.  A WAKE frame (which clients
    rang before filling their buffers until 2026-11-26) is read and dropped: the thread polling
    for the header after it cost the target's own send of the WAKE ~2.1 ms a step on a one-H200
    host (bench/results/2026-11-26-h200-e2e-stages/).

An armed binding (BindRequest.armed, wb.ARM_WORDS) starts each step from the target's GPU instead: the
steps run on the binding's own stream, each behind a GPU wait for a go word the target copies after its
inputs, and after each reply the doorbell thread queues the next step ahead (IpcBoundSession's "armed
steps" section; whoever else takes the engine's lock drains it first, drafter.service.engine_lock).

The target reads the drafts and the error word together after its stream waited on the event,
and turns a set word into INVALID_ARGUMENT naming the first bad field (coordinator.transport.
bound_ipc).  Whatever the slab holds, every KV write of the step stays inside the session's own
blocks: the guard moved each block id and slot there or to the padding slot.

The slabs' backend is TorchSlabs (CUDA IPC) on a drafter that serves CUDA IPC (--allow-cuda-ipc,
the GPU the target names); the tests replace BACKEND with cuda_slab.LocalSlabs to run the same
plane on CPU within one process.

GuardedRingSession is the host ring on a drafter whose engine is on a GPU: the step's frame lands
in the pinned ring as before (recv_into), then one host-to-device copy of its used prefix into a
device slab, and the same GPU guard and bound graphs as above; the drafts and the error word come
back in one copy.  No per-field pass on the CPU (the CPU drafter keeps bound_sessions' checks,
which refuse a corrupt step before the engine; here a corrupt step runs masked, as on cuda_ipc,
and is answered INVALID_ARGUMENT naming the first bad field).
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import zmq

from drafter.engine.step_guard import GuardLimits, StepGuard
from drafter.service.bound_sessions import POLL_MS, BoundSession, _view, _width
from drafter.service.engine_lock import EngineLock
from drafter.wire import bound as wb
from drafter.wire import cuda_slab, doorbell
from drafter.wire.errors import Code, DrafterError, InvalidInput, invalid

log = logging.getLogger("drafter.service.bound")

BACKEND = None  # None: cuda_slab.TorchSlabs (the tests put a LocalSlabs here)
HELLO_TIMEOUT_S = 2.0  # a doorbell connection that sends no hello in this time is closed
DRAIN_S = 2.0  # an armed binding's queued steps get this long to run when another user drains them
_MESSAGE = 2000  # characters of an INTERNAL step error's message (a doorbell frame stays small)
SLAB = "slab"
GUARDED_RING = None  # None: the host ring is guarded on the GPU where the engine is on one; the tests force it


def _backend(core):
    """The slabs' backend, refused (naming "slab.device_uuid") where this drafter does not serve CUDA IPC."""
    if BACKEND is not None:
        return BACKEND, None
    if not core.cuda_ipc.enabled:
        raise invalid(f"{SLAB}.device_uuid", f"this drafter does not open CUDA IPC buffers: {core.cuda_ipc.reason}")
    return cuda_slab.TorchSlabs(), core.cuda_ipc


_waiting = [0]  # bound steps waiting for the engine's lock now (steps_waiting)
_waiting_lock = threading.Lock()


def steps_waiting() -> int:
    """How many bound steps wait for the engine's lock now: a pre-draft yields to them (issue 23)."""
    return _waiting[0]


_thread_device = threading.local()  # the device each data / doorbell thread last made current


def on_engine(session, fn, *args, step: bool = True):
    """fn(*args) on the calling (data) thread under the engine's lock, EngineThread.engine_lock: no
    hop to the engine thread and back; on the engine thread where the executor has no such lock.
    step: a step's work, counted in steps_waiting() while it waits for the lock (a pre-draft's is not)."""
    lock = getattr(session.core.executor, "engine_lock", None)
    if lock is None:
        return session.core.executor.submit(fn, *args).result()
    stream = getattr(session, "stream", None)  # an armed binding's own stream (IpcBoundSession)
    if getattr(_thread_device, "device", None) != (session.device, stream):  # the current device is per thread
        if session.device.type == "cuda":
            torch.cuda.set_device(session.device)
            torch.cuda.set_stream(stream or torch.cuda.default_stream(session.device))
        _thread_device.device = (session.device, stream)
    take = (lambda blocking: lock.acquire(blocking, owner=session)) if isinstance(lock, EngineLock) \
        else lock.acquire
    if not step:
        take(True)
    elif not take(False):  # held: wait, counted
        with _waiting_lock:
            _waiting[0] += 1
        try:
            take(True)
        finally:
            with _waiting_lock:
                _waiting[0] -= 1
    try:
        return fn(*args)
    finally:
        lock.release()


def ring_session_class(engine):
    """The host ring's session class for this engine: GuardedRingSession on a GPU (or as
    GUARDED_RING says), else None (bound_sessions' own, its checks on the CPU)."""
    use = torch.device(engine.device).type == "cuda" if GUARDED_RING is None else GUARDED_RING
    return GuardedRingSession if use else None


def _engine_device(engine) -> torch.device:
    device = torch.device(engine.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class _Guarded:
    """The guard over the session's views, the engine bound to its outputs, the output buffer
    (drafts, then the error word)."""

    def _bind_engine(self, engine, s, max_batch: int, armed: bool = False) -> None:
        """The output allocated (with the arm row where armed), the guard captured, the engine bound."""
        width = _width(engine)
        words = wb.arm_words(max_batch, width, armed)  # whole 64-byte rows; the target's output is as long
        self.output = torch.zeros(words, dtype=torch.int64, device=self.device)  # [drafts..., error, pad, arm row]
        self.drafts = self.output[:max_batch * width].view(max_batch, width)
        self.error = self.output[max_batch * width:max_batch * width + 1]
        desc = self.core.desc
        limits = GuardLimits(vocab_size=desc.vocab_size, max_model_len=s.max_model_len,
                             num_speculative_tokens=desc.verify_width, num_blocks=tuple(s.num_blocks),
                             block_sizes=tuple(s.block_sizes), bases=tuple(s.bases))
        self.guard = StepGuard(self.views, limits, self.error)
        o = self.guard.out
        try:
            self.bound = engine.bind(
                target_token_ids=o["target_token_ids"], target_positions=o["target_positions"],
                target_hidden_states=self.views[wb.HIDDEN], next_token_ids=o["next_token_ids"],
                query_start_loc=o["query_start_loc"], seq_lens=o["seq_lens"],
                block_tables=[o[f"block_tables[{g}]"] for g in range(self.groups)],
                slot_mappings=[o[f"slot_mappings[{g}]"] for g in range(self.groups)],
                token_indices_to_sample=o.get("token_indices_to_sample"),
                num_rejected_tokens=o.get("num_rejected_tokens"), drafts=self.drafts)
        except InvalidInput as exc:
            raise invalid(exc.field, str(exc)) from None
        self.bound.fold(self.guard)  # the guard inside the bound graphs: one replay a step

    def _check_sizes(self, head: wb.StepHeader) -> None:
        n, b, s = head.num_tokens, head.batch, self.session
        if not 0 < b <= min(self.drafts.shape[0], s.max_num_seqs):
            raise invalid("batch_size", f"{b} must lie in [1, {min(self.drafts.shape[0], s.max_num_seqs)}]")
        if not b <= n <= min(s.max_num_batched_tokens, self.bound.max_tokens):
            raise invalid("num_tokens", f"{n} must lie in [batch={b}, "
                                        f"{min(s.max_num_batched_tokens, self.bound.max_tokens)}]")

    def _guarded_rows(self, head: wb.StepHeader):
        """A fused step's part after its inputs are in place (fuse_part): the guard run alone, the
        call counted; the guard's rows for the fused engine call."""
        self.guard.step(head.num_tokens, head.batch)
        self.session.calls += 1
        self.session.last_used = time.monotonic()
        return self.bound.rows(head.num_tokens, head.batch)

    def _replay(self, head: wb.StepHeader) -> None:
        """Queued on the stream: the bound graphs, which start with the guard (BoundPropose.fold:
        its sizes from the header the call stores; one replay at a combined decode size)."""
        s = self.session
        s.calls += 1
        s.last_used = time.monotonic()
        try:
            self.bound.propose(head.num_tokens, head.batch, head.batch_padded or None, head.tokens_padded or None)
        except InvalidInput as exc:
            raise invalid(exc.field, str(exc)) from None


class GuardedRingSession(_Guarded, BoundSession):
    """A host-ring session on a GPU drafter: pinned ring -> one copy to the GPU -> guard -> replay."""

    def __init__(self, plane, s, req: wb.BindRequest, slots: list[wb.Slot], total: int):
        self._own(plane, s, slots)
        engine = self.core.engine
        self.device = _engine_device(engine)
        pinned = self.device.type == "cuda"
        self.ring = torch.zeros(total, dtype=torch.uint8, pin_memory=pinned)  # [total]: the frames land here
        self.slab = torch.zeros(total, dtype=torch.uint8, device=self.device)  # [total]: the step on the GPU
        self.views = {sl.name: _view(self.slab, sl) for sl in slots}
        self.groups = len(s.num_blocks)
        self._bind_engine(engine, s, req.max_batch)
        self._host_out = torch.zeros(self.output.shape, dtype=torch.int64, pin_memory=pinned)  # [words]
        self._link_state(req)

    def _on_engine(self, fn, *args):
        return on_engine(self, fn, *args)

    def fuse_part(self, head: wb.StepHeader, nbytes: int):
        """A fused step (drafter.service.batching.bound_steps): sizes checked, the prefix to the GPU,
        the guard run alone (every field checked and masked, the error word set); the guard's rows."""
        self._check_sizes(head)
        want = wb.step_bytes(self.slots, head.num_tokens)
        if nbytes != want:
            raise invalid("ring", f"{nbytes} bytes for {head.num_tokens} tokens; the layout needs {want}")
        self._check_plan(head)
        self._stage(nbytes)
        return self._guarded_rows(head)

    def fused_drafts(self, head: wb.StepHeader, rows: torch.Tensor) -> None:  # rows: [batch, width] int64
        """The drafts into the output, the output (with the error word) to the host, queued."""
        self.drafts[:rows.shape[0]].copy_(rows)
        self._host_out.copy_(self.output, non_blocking=True)

    def _stage(self, nbytes: int) -> None:
        """The ring's used prefix to the GPU slab, one copy queued (the ring stream stages it chunk
        by chunk as it lands instead: drafter.service.ring_stream)."""
        self.slab[:nbytes].copy_(self.ring[:nbytes], non_blocking=True)

    def step(self, head: wb.StepHeader, nbytes: int) -> bytes:
        """The prefix to the GPU, guard, replay, drafts and error word back; the drafts' bytes or
        INVALID_ARGUMENT naming the first field the guard masked."""
        self._check_sizes(head)
        want = wb.step_bytes(self.slots, head.num_tokens)
        if nbytes != want:
            raise invalid("ring", f"{nbytes} bytes for {head.num_tokens} tokens; the layout needs {want}")
        self._stage(nbytes)
        self._replay(head)
        self._host_out.copy_(self.output, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # also: the ring may take the next frame
        return self.fused_reply(head)

    def fused_reply(self, head: wb.StepHeader) -> bytes:
        """The output on the host: the drafts' bytes, or INVALID_ARGUMENT naming the guard's first field."""
        word = int(self._host_out[self.drafts.numel()])
        if word:
            raise invalid(wb.first_bad_guard_field(word, self.groups),
                          "out of range for this session (or not finite); the step's rows were masked, "
                          "its drafts are void")
        return self._host_out[:head.batch * self.drafts.shape[1]].numpy().tobytes()


class _Doorbell:
    """A binding's doorbell (drafter.wire.doorbell) beside its data socket, where the Bind asked for
    one: its own thread takes the target's connection, then each step's header and answers with
    self._answer(frame, extra, received) -> (StepDone, accepted counts), as the data thread does."""

    def open(self, ctx: zmq.Context, endpoint: str) -> None:
        """The data socket and its thread; and where the Bind asked for one, the doorbell's thread."""
        try:
            super().open(ctx, endpoint)
        except BaseException:  # the Bind fails: its doorbell goes with it
            if self._listener is not None:
                self._listener.close()
            raise
        if self._listener is not None:
            self._bell_thread = threading.Thread(target=self._serve_doorbell, name=f"bell-{self.bind_id[:8]}",
                                                 daemon=True)
            self._bell_thread.start()

    def join(self, timeout_s: float = 10.0) -> None:
        super().join(timeout_s)
        if self._bell_thread is not None:
            self._bell_thread.join(timeout_s)

    def _receive_and_run(self, sock: zmq.Socket, ring) -> tuple[wb.StepDone, bytes]:
        """The data socket's step: [StepHeader] only (the inputs are in the target's shared buffers or come
        down a channel); frames after it are counted and the step refused."""
        received = time.perf_counter_ns()
        header_frame = sock.recv() if sock.getsockopt(zmq.RCVMORE) else b""
        extra = 0
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv()
            extra += 1
        done, self._accepted = self._answer(header_frame, extra, received)
        return done, b""

    def _open_doorbell(self, req: wb.BindRequest) -> None:
        """A listening doorbell where the Bind asked for one and the platform has it (else none:
        the target steps on the data socket)."""
        self._listener, self.doorbell_address, self._bell_thread = None, "", None
        self._spin_s = req.spin_us / 1e6  # checked by BoundPlane.bind
        if not req.doorbell or not doorbell.available():
            return
        try:
            self._listener, self.doorbell_address = doorbell.listen()
        except OSError as exc:
            log.info("no doorbell for the binding: %s", exc, extra={"event": "bind_doorbell_unavailable"})

    def _serve_doorbell(self) -> None:
        """The doorbell's thread: the target's connection (its hello checked), then its steps,
        until the binding ends or the target hangs up."""
        listener, conn = self._listener, None
        poll_s = POLL_MS / 1e3
        try:
            conn = doorbell.accept(listener, self.bind_id, self._alive, poll_s, HELLO_TIMEOUT_S)
            listener.close()
            if conn is None:
                return
            while not self._steps_ready.wait(poll_s):  # the channel planes: the group built by the data thread
                if not self._alive():
                    return
            conn.settimeout(poll_s)
            self._doorbell_steps(conn)
        except OSError as exc:
            log.debug("bound doorbell ended: %s", exc)
        finally:
            listener.close()
            if conn is not None:
                conn.close()

    def _doorbell_steps(self, conn) -> None:
        """Each header in, its StepDone out.  With the Bind's spin_us the thread polls that long
        after each reply, and a frame caught so is taken without sleeping.  A WAKE is dropped
        (module docstring: polling after it slowed the target's send)."""
        scratch = bytearray(doorbell.MAX_FRAME)
        caught = None  # a frame a spin caught
        while self._alive():
            frame, caught = (caught if caught is not None else self._refusing(conn, None)), None
            if frame is None or frame == doorbell.WAKE:
                continue
            if not frame:
                return  # the target closed its end: it steps on the data socket, or binds again
            pre = getattr(self, "_predrafts", None)  # the channel planes' sessions have none
            if pre is not None and pre.note_taken(frame):  # a TAKEN no pre-draft waited for (issue 23)
                continue
            done, accepted = self._answer(frame, 0, time.perf_counter_ns())
            conn.send(wb.encode(done))
            # pre-drafts the step asked for (issue 23); a frame read while one waited for the target's TAKEN
            caught = self._push(done, conn.send, doorbell.MAX_FRAME, lambda s: self._within(conn, s))
            if getattr(self, "armed", False) and not done.code:  # the next step queued ahead, after the reply
                on_engine(self, self._queue_ahead, done.step + 1, step=False)
            if accepted and not done.code:  # after the reply: off the step's path
                self.core.metrics.record_acceptance(torch.tensor(accepted), self.core.desc.num_speculative_tokens)
            if self._spin_s and caught is None:
                caught = self._refusing(conn, (self._spin_s, scratch))

    def _within(self, conn, seconds: float) -> bytes | None:
        """The next frame within `seconds` (None: none came), the socket's own timeout kept."""
        timeout = conn.gettimeout()
        conn.settimeout(max(seconds, 1e-6))
        try:
            return self._refusing(conn, None)
        finally:
            conn.settimeout(timeout)

    @staticmethod
    def _refusing(conn, spin: tuple | None) -> bytes | None:
        """The next frame (asleep, or with spin = (seconds, scratch) awake; None: none came); a frame
        too long for a header is answered INVALID_ARGUMENT here and counts as none."""
        try:
            return doorbell.receive(conn, None) if spin is None else doorbell.spin(conn, *spin)
        except doorbell.FrameTooLong as exc:
            conn.send(wb.encode(wb.StepDone(step=0, code=int(Code.INVALID_ARGUMENT), field="header",
                                            message=str(exc))))
            return None


def _predrafting(session) -> bool:
    """Whether this drafter pre-drafts (--predraft-outcomes)."""
    service = getattr(getattr(session.core, "runner", None), "predrafts", None)
    return service is not None and service.enabled


def _bound_predrafts(session):
    """The binding's pre-drafter where the drafter pre-drafts (--predraft-outcomes), else None."""
    from drafter.service.predraft import BoundPreDrafts

    service = getattr(getattr(session.core, "runner", None), "predrafts", None)
    if service is None or not service.enabled:
        return None
    return BoundPreDrafts(service, session.core.engine, session.session, session.views, session.guard.out,
                          session.drafts, session.device, session.core.epoch, waiting=steps_waiting)


class IpcBoundSession(_Doorbell, _Guarded, BoundSession):
    """One session bound over CUDA IPC: the target's slab, the guard, the engine binding, the events."""

    def __init__(self, plane, s, req: wb.BindRequest, slots: list[wb.Slot], total: int):
        self._own(plane, s, slots)
        engine = self.core.engine
        self.backend, support = _backend(self.core)
        ref = cuda_slab.check_ref(req.slab, SLAB, total)
        if support is not None and ref.device_uuid not in support.device_uuids:
            raise invalid(f"{SLAB}.device_uuid", f"GPU {ref.device_uuid[:64]} is not one this drafter reads")
        self.device = _engine_device(engine)
        self.slab = self.backend.open(ref, self.device, SLAB)  # [total] uint8, the target's memory
        self.ring = torch.empty(0, dtype=torch.uint8)  # no bytes arrive on the data socket
        self.views = {sl.name: _view(self.slab, sl) for sl in slots}
        self.groups = len(s.num_blocks)
        self.inputs_event = self.backend.open_event(ref.step_event_handle, self.device, SLAB)
        self.done_event, self.done_handle = self.backend.new_event(self.device)
        # armed (wb.ARM_WORDS): where asked, and the backend can wait on words; not beside pre-drafts, whose
        # work runs on the default stream between steps
        self.armed = bool(getattr(req, "armed", False)) and not _predrafting(self) and self.backend.can_arm() \
            and isinstance(getattr(self.core.executor, "engine_lock", None), EngineLock)  # (older decoders: no field)
        self._bind_engine(engine, s, req.max_batch, self.armed)
        self.output_ref = self.backend.share(self.output.view(torch.uint8), self.done_handle)
        self._predrafts = _bound_predrafts(self)  # StepHeader.want_predrafts (drafter.service.predraft)
        self._wait_inputs = self._record_done = None  # _events(), at the first step
        self._fine: tuple[int, ...] = ()
        self.stream = None
        if self.armed:
            self._arm_state()
        self._link_state(req)
        self._open_doorbell(req)

    # ------------------------------------------------------------------ data socket
    def _answer(self, header_frame: bytes, extra: int, received: int) -> tuple[wb.StepDone, list[int]]:
        """One step's StepDone from its header frame (extra: frames that came after it), and the
        rows' accepted counts to record after the reply ([] for none or a refused step)."""
        try:
            head = wb.STEP_DECODER.decode(header_frame)
        except Exception as exc:  # noqa: BLE001 - msgspec's errors name the path
            return wb.StepDone(step=0, code=int(Code.INVALID_ARGUMENT), field="header", message=str(exc)), []
        if extra:
            return self._refused(head, invalid("frames", "a cuda_ipc step is [StepHeader] alone")), []
        try:
            self.admit(head)
            started, queued, fine = self._run(head)
        except DrafterError as exc:
            return self._refused(head, exc), []
        except Exception as exc:  # noqa: BLE001 - a bug of ours: the step still gets its answer
            log.exception("cuda_ipc bound step failed")
            return wb.StepDone(step=head.step, code=int(Code.INTERNAL), message=repr(exc)[:_MESSAGE]), []
        stamps = [received, started, queued, time.perf_counter_ns(), *fine]
        return wb.StepDone(step=head.step, stamps=stamps), list(head.accepted_counts)

    def _run(self, head: wb.StepHeader) -> tuple[int, int, tuple[int, ...]]:
        """The step (on_engine); perf_counter_ns when it began, when its GPU work was queued, and
        wb.FINE_STAMPS' points between.  Unarmed, inside other bindings' fused engine call where
        their steps are pending too (drafter.service.batching.bound_steps); armed, never fused."""
        if self.armed:
            return on_engine(self, self._timed, head)
        return self.plane.steps.run(self, head, 0, self._on_engine)

    def _on_engine(self, fn, *args):
        return on_engine(self, fn, *args)

    # a fused step (drafter.service.batching.bound_steps): no host read, as alone
    host_reply = False  # the target reads the drafts and the error word from the shared output

    def serve_alone(self, head: wb.StepHeader, nbytes: int) -> tuple[int, int, tuple[int, ...]]:
        return self._timed(head)

    def fuse_part(self, head: wb.StepHeader, nbytes: int):
        """Sizes checked, the stream waits for the target's event, the guard run alone (every field
        checked and masked, the error word into the output); the guard's rows."""
        self._check_sizes(head)
        if head.nbytes:
            raise invalid("nbytes", "a cuda_ipc step ships no bytes")
        self._check_plan(head)
        if self._wait_inputs is None:
            self._events()
        self._wait_inputs()
        return self._guarded_rows(head)

    def fused_drafts(self, head: wb.StepHeader, rows: torch.Tensor) -> None:  # rows: [batch, width] int64
        """The drafts into the shared output, the pre-draft rows kept, the "drafts ready" event recorded."""
        self.drafts[:rows.shape[0]].copy_(rows)
        if head.want_predrafts and self._predrafts is not None:
            self._predrafts.keep(head)
        self._record_done()

    def fused_stamps(self, started: int, queued: int) -> None:
        self._fused_at = (started, queued)

    def fused_reply(self, head: wb.StepHeader) -> tuple[int, int, tuple[int, ...]]:
        started, queued = self._fused_at
        return started, queued, (started, started, queued)

    def _timed(self, head: wb.StepHeader) -> tuple[int, int, tuple[int, ...]]:
        started = time.perf_counter_ns()
        self.step(head, 0)
        return started, time.perf_counter_ns(), self._fine

    # ------------------------------------------------------------------ one step (engine lock held)
    def step(self, head: wb.StepHeader, nbytes: int) -> bytes:
        """Wait for the target's writes, guard, replay, mark the drafts ready: all queued, no host read."""
        self._check_sizes(head)
        if head.nbytes:
            raise invalid("nbytes", "a cuda_ipc step ships no bytes")
        if self.armed:
            return self._armed_step(head)
        if self._wait_inputs is None:  # the first step, on the thread that runs them
            self._events()
        self._wait_inputs()
        waited = time.perf_counter_ns()
        self._replay(head)  # the guard inside: no call of its own ("guarded" is "waited")
        replayed = time.perf_counter_ns()
        if head.want_predrafts and self._predrafts is not None:  # the rows it drafts from, before the slab goes back
            self._predrafts.keep(head)
        self._record_done()
        self._fine = (waited, waited, replayed)
        return b""

    def _push(self, done: wb.StepDone, send, limit: int = 0, receive=None) -> bytes | None:
        """After a StepDone with code 0 whose step asked: pre-draft, push on `send` (frames over
        `limit` bytes, where one is given, go as an empty set: the doorbell's frames are bounded).
        receive(seconds): the doorbell's next frame, for the pre-draft's wait for the target's TAKEN;
        returns a frame it read that was not one (the caller's next), else None."""
        pre = self._predrafts
        if pre is None or pre.pending is None:
            return None
        if done.code:
            pre.pending = None
            return None
        return pre.after_reply(send, lambda fn, *args: on_engine(self, fn, *args, step=False), limit, receive)

    def _events(self) -> None:
        """The inputs event's wait and the done event's record on this thread's stream, looked up
        once (torch.cuda.current_stream: ~6-10 us a call on a GPU host, bench/results/
        2026-11-25-h100-host-ops); through the backend where it is not TorchSlabs (the tests')."""
        if isinstance(self.backend, cuda_slab.TorchSlabs):
            stream = torch.cuda.current_stream(self.device)
            inputs, done = self.inputs_event, self.done_event
            self._wait_inputs = lambda: inputs.wait(stream)
            self._record_done = lambda: done.record(stream)
        else:
            backend, device = self.backend, self.device
            self._wait_inputs = lambda: backend.wait(self.inputs_event, device)
            self._record_done = lambda: backend.record(self.done_event, device)

    # ------------------------------------------------------------------ armed steps (wb.ARM_WORDS)
    # The binding's steps run on a stream of its own (on_engine makes it its threads' current one).  A
    # step is queued as: a GPU wait until the go word reaches its number, the arm kernel (the header's
    # sizes from the target's record where it is this step's, else none: drafter.kernels.arm), the
    # folded graph, the step's event (drafts_event on even steps, drafts_event_odd on odd ones: the
    # next step's record may be queued before the target waits on this one's).  After each reply the
    # doorbell thread queues the next step ahead, with the last step's sizes, where this binding alone
    # took the engine since its last step; its header then finds it queued (nothing to do but reply),
    # or queues the step again for its own sizes (the one queued ahead does nothing).  Whoever else
    # takes the engine's lock drains the binding first (drain).  On CPU (the tests' LocalSlabs) a
    # queued step is kept and run once the go word has reached it.
    def _arm_state(self) -> None:
        words = self.output.numel() - wb.ARM_WORDS
        self.arm_row = self.output[words:]  # [ARM_WORDS] int64: the go word, the target's record
        self.go = self.arm_row[wb.ARM_GO:wb.ARM_GO + 1].view(torch.int32)  # [2] int32: the two go words
        self._half = 0  # the go word this binding waits on (the other after it released one itself)
        self.odd_event, self.odd_handle = self.backend.new_event(self.device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._ahead: tuple | None = None  # (step, sizes) queued ahead of its header
        self._queued = 0  # the last step queued behind a wait for the go word
        self._deferred: list[tuple[int, int, object]] = []  # CPU: (step, go word, block) queued, not run yet
        self._last_key: tuple | None = None
        self._quiet = -1  # the engine lock's switches at the last attempt to queue ahead
        self._joined = -1  # the engine lock's switches when this stream last waited for the default one
        self.armed_steps = self.armed_hits = 0

    def _armed_step(self, head: wb.StepHeader) -> bytes:
        """One armed step, its header come: nothing to queue where the step queued ahead is this one
        (same number and sizes); else the step queued for its own sizes (the folded graph, or the
        guard and graphs of propose once the binding's queue has run)."""
        key = (head.num_tokens, head.batch, head.batch_padded, head.tokens_padded)
        started = time.perf_counter_ns()
        self._run_ready()
        hit = self._ahead == (head.step, key)
        self._ahead = None
        self.armed_steps += 1
        if not hit:
            try:
                graph = self.bound.armed_graph(*key)
            except InvalidInput as exc:
                raise invalid(exc.field, str(exc)) from None
            self._join_default()
            if graph is not None:
                self._enqueue(head.step, lambda: self._armed_block(head.step, key, graph))
            else:  # sizes without a folded graph: the header's sizes are stored by the host
                if not self._wait_queued(DRAIN_S):  # what is queued writes the header's sizes from the GPU
                    raise DrafterError(Code.DEADLINE_EXCEEDED, "", "the steps queued before this one did not run")
                self._enqueue(head.step, lambda: (self._replay(head), self._record(head.step)))
        self.armed_hits += hit
        self.core.metrics.armed_steps.labels("true" if hit else "false").inc()
        self._last_key = key
        queued = time.perf_counter_ns()
        self._fine = (started, started, queued)
        return b""

    def _armed_block(self, step: int, key: tuple, graph) -> None:
        """Queued behind the wait for step's go word: the arm kernel, the folded replay, the step's event."""
        self.session.calls += 1
        self.session.last_used = time.monotonic()
        self.bound.replay_armed(graph, self.arm_row, step, key)
        self._record(step)

    def _record(self, step: int) -> None:
        event = self.done_event if step % 2 == 0 else self.odd_event
        if self.stream is not None:
            event.record(self.stream)
        else:
            self.backend.record(event, self.device)

    def _enqueue(self, step: int, block) -> None:
        """block() queued behind a wait until the go word reaches step (on CPU: kept until it has)."""
        self._queued = step
        self.core.executor.engine_lock.armed = self  # whoever takes the engine next drains this binding
        if self.stream is not None:
            self.backend.wait_word(self.go[self._half:self._half + 1], step, self.device)
            block()
            return
        self._deferred.append((step, self._half, block))
        self._run_ready()

    def _run_ready(self) -> None:
        """CPU: run the queued blocks, in order, while the go word has reached theirs."""
        while self._deferred and _reached(int(self.go[self._deferred[0][1]]), self._deferred[0][0]):
            self._deferred.pop(0)[2]()

    def _join_default(self) -> None:
        """This binding's stream waits for the default stream's work, once after another owner used the engine."""
        lock = self.core.executor.engine_lock
        if self.stream is not None and lock.switches != self._joined:
            self.stream.wait_stream(torch.cuda.default_stream(self.device))
        self._joined = lock.switches

    def _queue_ahead(self, step: int) -> None:
        """Under the engine's lock, after step - 1's reply: step queued with the last step's sizes,
        where this binding alone took the engine since its last attempt and a folded graph covers them."""
        lock = self.core.executor.engine_lock
        quiet, self._quiet = lock.switches == self._quiet, lock.switches
        key = self._last_key
        if not quiet or key is None or self._ahead is not None or not self._alive():
            return
        try:
            graph = self.bound.armed_graph(*key)
        except InvalidInput:
            return
        if graph is None:
            return
        self._join_default()
        self._enqueue(step, lambda: self._armed_block(step, key, graph))
        self._ahead = (step, key)

    def drain(self) -> None:
        """Called by whoever takes the engine's lock next (drafter.service.engine_lock): the step queued
        ahead released (its go word written here: its record is not there, so it does nothing; a
        target whose record landed first has it run, and its header runs it again: the same writes),
        then the binding's queue waited for.  Steps whose headers came wait for the target's go words
        at most DRAIN_S; past that they are released too and the binding ends (its target sent
        steps it did not start)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._release(ahead[0])
        if self._wait_queued(DRAIN_S):
            return
        log.warning("an armed binding's steps did not start: binding ended", extra={"event": "armed_stalled"})
        for _ in range(2):  # every queued wait released (the binding ends: nothing waits on the words again)
            self._release(self._queued)
        self._wait_queued(DRAIN_S)
        self.stop()

    def _release(self, step: int) -> None:
        """The go word waited on written here (to step), and the other waited on from now: the
        target's own write of step is still waited for when its header comes (wb.ARM_GO)."""
        self.backend.release_word(self.go[self._half:self._half + 1], step, self.device)
        self._half ^= 1

    def _wait_queued(self, timeout_s: float) -> bool:
        """Whether the binding's queue ran within timeout_s (the host polls an event: no unbounded wait)."""
        if self.stream is None:
            self._run_ready()
            return not self._deferred
        with torch.cuda.device(self.device):  # a drain runs on whichever thread takes the engine's lock
            done = torch.cuda.Event()
            done.record(self.stream)
        deadline = time.monotonic() + timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0)  # the GPU runs the queue; other threads may run meanwhile
        return True

    def join(self, timeout_s: float = 10.0) -> None:
        super().join(timeout_s)
        lock = getattr(self.core.executor, "engine_lock", None)
        if getattr(self, "armed", False) and isinstance(lock, EngineLock) and lock.armed is self:
            with lock:  # taken by anyone else, the lock drains the binding
                pass


def _reached(word: int, step: int) -> bool:
    """The go word's cyclic comparison (int32): word has reached step."""
    return ((word - step) & 0xFFFFFFFF) < 0x80000000
