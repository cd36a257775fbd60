"""A GPU target's persistent buffers bound to a drafter on the same host over CUDA IPC.

    client = CudaIpcBoundClient("tcp://127.0.0.1:5555", layout, buffers, max_batch=64, device="cuda:0")
    bufs = client.views                        # the target's persistent buffers: views into one GPU slab
    ...                                        # every step the target fills their first rows (its stream)
    drafts = client.step(num_tokens, batch)    # [batch, width] int64 on the host, or
    drafts = client.step_async(num_tokens, batch)  # [batch, width] on the GPU, ordered on the stream

At bind the slab (and this side's "inputs ready" interprocess event) is shared once; the drafter
shares back its output (drafts, then an error word) and its "drafts ready" event, and the address
of the binding's doorbell (drafter.wire.doorbell), which the client connects to.  A step records
the inputs event on the current stream, sends the StepHeader alone (on the doorbell, else on the
data socket), waits for StepDone, and makes the current stream wait on the drafts event (or, where
the drafter's engine is on this GPU, same_gpu, waits for it on the host: two contexts time-slicing
one GPU do better so): no tensor bytes cross Python.  step()
then reads the drafts and the error word back together (one copy) and raises INVALID_ARGUMENT
naming the first field the drafter's GPU guard found out of range (drafter.wire.bound.guard_fields);
step_async() leaves the drafts on the GPU, and check() reads the word when the caller wants it.

The plane is chosen at bind from what both sides can do: the drafter advertised CUDA IPC for this
host and this GPU (AttachResponse.cuda_ipc) and accepted the slab.  Otherwise (another host,
another container, a drafter without --allow-cuda-ipc) the client falls back to the host ring
(coordinator.transport.bound_client.HostRingClient): each step one device-to-host copy of the
slab's used prefix into the ring's pinned slab, then the ring's step.  `plane` says which is in use.

Fails closed like HostRingClient: a deadline on every step; a drafter that forgot the binding (a
restart) is attached and bound again by the next step, which is refused with FAILED_PRECONDITION
(the new binding's KV is empty: resend the context).

IpcLink is one cuda_ipc binding's data path (the drafter's output opened, the data socket, the
header-only step, the error word); the RemoteProposer's BoundTransport uses it too, with its own
attach and Bind (coordinator.transport.bound_transport).
"""

from __future__ import annotations

import itertools
import time

import msgspec
import numpy as np
import torch
import zmq

from coordinator.transport.bound_client import _host, connect_socket, control_call, raise_if_refused, reachable
from drafter.wire import bound as wb
from drafter.wire import stream_ops
from drafter.wire import cuda_ref, cuda_slab, doorbell, schema
from drafter.wire.errors import Code, DrafterError
from drafter.wire.predraft import bound_push_from_frame, is_bound_push
from drafter.wire.tensors import DTYPES

_ATTACH = msgspec.msgpack.Decoder(schema.AttachResponse)
_DETACH = msgspec.msgpack.Decoder(schema.DetachResponse)
ENVIRONMENT = ("slab.handle", "slab.device_uuid", "slab.step_event_handle", "output.handle",
               "output.step_event_handle", "output.storage_size_bytes", "plane")  # refusals: fall back to the ring


def cannot_share(slabs, device: torch.device, support) -> str:
    """Why a target slab on `device` cannot be shared with a drafter advertising `support` (the
    AttachResponse's or InfoResponse's CudaIpcSupport); "" when it can."""
    if isinstance(slabs, cuda_slab.LocalSlabs):
        return ""
    if device.type != "cuda":
        return "the slab is not on a GPU"
    if support is None or not support.enabled:
        return f"the drafter does not serve CUDA IPC: {getattr(support, 'reason', 'not advertised')}"
    if support.host_id != cuda_ref.host_id():
        return "the drafter runs on another host"
    if cuda_ref.device_uuid(device) not in support.device_uuids:
        return "the drafter cannot read this GPU"
    return ""


_STREAMS: dict[tuple, torch.cuda.Stream] = {}  # (stream id, device index, device type) -> its Stream


def current_stream(device: torch.device) -> "torch.cuda.Stream":
    """torch.cuda.current_stream(device), the Stream object kept per stream: building one costs
    ~6-10 us on a GPU host (bench/results/2026-11-25-h100-host-ops), and a step needs the current
    stream three times (the inputs event, the wait on the drafts, the read back)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = torch._C._cuda_getCurrentStream(index)  # (stream id, device index, device type): one C call
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) >= 64:
            _STREAMS.clear()
        stream = _STREAMS[key] = torch.cuda.current_stream(device)
    return stream


class DeviceLink:
    """What the GPU planes' data paths share (IpcLink: cuda_ipc; coordinator.transport.
    bound_channel.ChannelLink: nccl_channel): the data socket, the StepDone exchange, the drafts as
    views of an output on this GPU ([max_batch * width + 1] int64: drafts, then the error word), its
    read-back.  `alive` turns False for good after anything that leaves the binding in doubt (a send
    with no live connection, a timeout, a lost session): bind again for a new link."""

    plane = ""

    def _setup(self, ctx: zmq.Context, device: torch.device, resp: wb.BindResponse, groups: int, via: str) -> None:
        """via: the control endpoint the Bind went to (a wildcard data endpoint is reached at its host)."""
        self.device, self.groups = device, groups
        self.resp = msgspec.structs.replace(resp, endpoint=reachable(resp.endpoint, _host(via)),
                                            store=reachable(resp.store, _host(via)) if resp.store else "")
        self.width = resp.drafts_width
        self.sock = connect_socket(ctx, self.resp.endpoint, data=True)
        self.bell = None  # the binding's doorbell (drafter.wire.doorbell) once open_doorbell() made it
        self.bell_reason = ""  # why a doorbell the drafter offered is not used
        self.alive = True
        self._steps = itertools.count(1)
        self._drafts_views: dict[int, torch.Tensor] = {}  # batch -> [batch, width] view of the output
        self._host_out: torch.Tensor | None = None  # [max_batch * width + 1] int64, pinned: read_back()
        self._host_word: torch.Tensor | None = None  # [1] int64, pinned: error_word()
        self.host_ns = 0  # the last step's host time on this side, the wait for the reply excluded
        self._waited_ns = 0
        # the last step's perf_counter_ns on both sides (CLOCK_MONOTONIC, one host): "sent", the
        # drafter's wb.STAMPS, "answered" (the reply read); CudaIpcBoundClient.step adds "read"
        self.stamps: dict[str, int] = {}
        # pushed pre-drafts (StepHeader.want_predrafts, drafter.wire.predraft.BOUND_PUSH): each set read
        # while waiting for a StepDone or in poll_pushes goes to on_push(PreDrafts); a step sent without
        # waiting (send_nowait) has its StepDone read by settle(), or kept here when a poll read it first
        self.on_push = None
        self.predraft_min_hits = 0.0  # StepHeader.predraft_min_hits of the steps that ask for pre-drafts
        self.session_id = ""  # the session a push must name ("": any; the client that bound sets it)
        self.last_step = 0  # the last step sent (the next is last_step + 1)
        self._unawaited = 0  # a step sent by send_nowait whose StepDone settle() has not read yet
        self._early: dict[int, wb.StepDone] = {}
        self._scratch: bytearray | None = None  # a doorbell frame's room for non-blocking reads

    def connect(self, timeout_s: float, channel_timeout_s: float = 0.0) -> bool:
        """Wait (at most timeout_s) until the data socket is connected; False if it did not in time."""
        return bool(self.sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLOUT))

    def open_doorbell(self, timeout_s: float) -> bool:
        """Connect the doorbell the Bind's reply named (at most timeout_s): the steps go there,
        one kernel wake-up each way instead of ZMQ's I/O threads.  False (bell_reason says why)
        where none was offered or it cannot be reached: the steps keep the data socket."""
        if not self.resp.doorbell:
            self.bell_reason = "the drafter offered no doorbell"
            return False
        try:
            self.bell = doorbell.connect(self.resp.doorbell, self.resp.bind_id, max(timeout_s, 0.001))
        except (OSError, ValueError) as exc:
            self.bell_reason = f"the doorbell {self.resp.doorbell[:64]} cannot be used: {exc}"
            return False
        return True

    def close(self) -> None:
        self.alive = False
        if self.bell is not None:
            self.bell.close()
        if not self.sock.closed:
            self.sock.close(linger=0)

    def exchange(self, num_tokens: int, batch: int, batch_padded: int, tokens_padded: int, timeout_s: float,
                 accepted_counts: list[int] | None = None, want_predrafts: bool = False) -> int:
        """The plane's part before the header (_before_send), header sent, StepDone read, the plane's
        part after it (_after_reply), stamps kept; perf_counter_ns at the start.  DrafterError: UNAVAILABLE 'data' when the data socket has no live connection
        (nothing was sent), the drafter's refusal, or DEADLINE_EXCEEDED."""
        start = time.perf_counter_ns()
        step, sent = self._send_step(num_tokens, batch, batch_padded, tokens_padded, timeout_s, accepted_counts,
                                     want_predrafts)
        done = self._reply(step, timeout_s)
        self._after_reply(timeout_s)
        self.stamps = {"sent": sent, **dict(zip(wb.STAMPS, done.stamps)),
                       **dict(zip(wb.FINE_STAMPS, done.stamps[len(wb.STAMPS):])), "answered": time.perf_counter_ns()}
        return start

    def _send(self, frame: bytes) -> None:
        """The header on the doorbell, or the data socket; UNAVAILABLE 'data' where it has no live
        connection (nothing was sent)."""
        if self.bell is not None:
            try:
                self.bell.send(frame)
                return
            except OSError as exc:  # the drafter's end is gone (a restart): nothing was sent
                self.close()
                raise DrafterError(Code.UNAVAILABLE, "data", f"the doorbell is closed: {exc}") from None
        try:
            self.sock.send(frame, flags=zmq.NOBLOCK)
        except zmq.Again:  # no live connection: the drafter (or this binding) went away
            self.close()
            raise DrafterError(Code.UNAVAILABLE, "data", f"no live connection to {self.resp.endpoint}") from None

    def _reply(self, step: int, timeout_s: float) -> wb.StepDone:
        if self.bell is not None:
            return self._bell_reply(step, timeout_s)
        deadline = time.monotonic() + timeout_s
        self._waited_ns = 0
        early = self._early.pop(step, None)
        if early is not None:  # read by poll_pushes
            raise_if_refused(early, self.close)
            return early
        while True:
            left = deadline - time.monotonic()
            t0 = time.perf_counter_ns()
            ready = left > 0 and self.sock.poll(int(left * 1000) + 1)
            self._waited_ns += time.perf_counter_ns() - t0
            if not ready:
                self.close()  # the drafter may still read the slab: this binding is in doubt
                raise DrafterError(Code.DEADLINE_EXCEEDED, "", f"bound step {step}: no reply in {timeout_s:.3f} s")
            frames = self.sock.recv_multipart()
            if is_bound_push(frames[0]):  # a pushed pre-draft set, read while waiting
                self._pushed(frames[0])
                continue
            done = wb.DONE_DECODER.decode(frames[0])
            if done.step != step:
                continue  # an answer to a step that already timed out
            raise_if_refused(done, self.close)
            return done

    def _bell_reply(self, step: int, timeout_s: float) -> wb.StepDone:
        """The step's StepDone from the doorbell within timeout_s (else DEADLINE_EXCEEDED); a
        doorbell the drafter closed is UNAVAILABLE at once.  Either leaves the link closed."""
        deadline = time.monotonic() + timeout_s
        t0 = time.perf_counter_ns()
        early = self._early.pop(step, None)
        if early is not None:  # read by poll_pushes
            self._waited_ns = 0
            raise_if_refused(early, self.close)
            return early
        try:
            while True:
                left = deadline - time.monotonic()
                frame = doorbell.receive(self.bell, left) if left > 0 else None
                if frame is None:
                    self.close()  # the drafter may still read the slab: this binding is in doubt
                    raise DrafterError(Code.DEADLINE_EXCEEDED, "", f"bound step {step}: no reply in {timeout_s:.3f} s")
                if not frame:
                    self.close()
                    raise DrafterError(Code.UNAVAILABLE, "", f"bound step {step}: the drafter closed the doorbell")
                if is_bound_push(frame):  # a pushed pre-draft set, read while waiting
                    self._pushed(frame)
                    continue
                done = wb.DONE_DECODER.decode(frame)
                if done.step == step:
                    raise_if_refused(done, self.close)
                    return done
        except (OSError, ValueError) as exc:  # a reset connection, a frame that is not a StepDone
            self.close()
            raise DrafterError(Code.UNAVAILABLE, "", f"bound step {step}: the doorbell failed: {exc}") from None
        finally:
            self._waited_ns = time.perf_counter_ns() - t0

    def step_async(self, num_tokens: int, batch: int, batch_padded: int, tokens_padded: int, timeout_s: float,
                   accepted_counts: list[int] | None = None, want_predrafts: bool = False) -> torch.Tensor:
        """One step, no host read: [batch, width] int64, a view of the drafter's output on this
        GPU, which the current stream's later work sees (it waits on the drafts event).  The
        view is the next step's output too: copy what must outlive it."""
        start = self.exchange(num_tokens, batch, batch_padded, tokens_padded, timeout_s, accepted_counts,
                              want_predrafts)
        self._arrive()
        drafts = self._drafts_views.get(batch)
        if drafts is None:
            drafts = self._drafts_views[batch] = self.output[:batch * self.width].view(batch, self.width)
        self.host_ns = time.perf_counter_ns() - start - self._waited_ns
        return drafts

    def send_nowait(self, num_tokens: int, batch: int, batch_padded: int, tokens_padded: int, timeout_s: float,
                    accepted_counts: list[int] | None = None, want_predrafts: bool = True) -> int:
        """A step whose drafts the target does not wait for (it verifies pushed pre-drafts): the
        header sent, nothing read; the drafter still writes the step's KV (and pushes its next
        pre-drafts).  settle() must run before the target writes its buffers again: it reads
        the StepDone and orders this side's later work after the drafter's reads of the slab.
        The step number."""
        step, _ = self._send_step(num_tokens, batch, batch_padded, tokens_padded, timeout_s, accepted_counts,
                                  want_predrafts)
        self._unawaited = step
        return step

    def _send_step(self, num_tokens: int, batch: int, batch_padded: int, tokens_padded: int, timeout_s: float,
                   accepted_counts: list[int] | None, want_predrafts: bool) -> tuple[int, int]:
        """A step's header built and sent after the plane's part before it (_before_send), an
        unawaited step settled first; (its step number, perf_counter_ns just before the send)."""
        if self._unawaited:
            self.settle(timeout_s)
        step = self.last_step = next(self._steps)
        head = wb.StepHeader(step=step, num_tokens=num_tokens, batch=batch, batch_padded=batch_padded,
                             tokens_padded=tokens_padded, nbytes=self._nbytes(num_tokens),
                             bind_id=self.resp.bind_id, accepted_counts=accepted_counts or [],
                             want_predrafts=want_predrafts,
                             predraft_min_hits=self.predraft_min_hits if want_predrafts else 0.0)
        self._before_send(head)
        sent = time.perf_counter_ns()
        self._send(wb.encode(head))
        return step, sent

    def settle(self, timeout_s: float) -> None:
        """The StepDone of a step sent by send_nowait (DrafterError as a step's), then the plane's
        arrival (the current stream waits for the drafter's output): the target's buffers are its
        own again.  Nothing when no such step is out.  That step's error word is read too: a step
        the guard masked (its drafts and KV void) is INVALID_ARGUMENT naming the field here, at the
        next step, as an awaited step's is at its own."""
        step, self._unawaited = self._unawaited, 0
        if step:
            self._reply(step, timeout_s)
            self._after_reply(timeout_s)
            self._arrive()
            self.raise_for(self.error_word())

    def poll_pushes(self, timeout_s: float = 0.0, until=None) -> None:
        """Read what the drafter pushed (each set to on_push), for at most timeout_s or until
        until() is true; an unawaited step's StepDone read here is kept for settle()."""
        deadline = time.monotonic() + timeout_s
        while self.alive and not (until is not None and until()):
            left = max(0.0, deadline - time.monotonic())
            frame = self._next_frame(left)
            if frame is None:
                return
            if is_bound_push(frame):
                self._pushed(frame)
                continue
            done = wb.DONE_DECODER.decode(frame)
            if done.step == self._unawaited:
                self._early[done.step] = done

    def _next_frame(self, timeout_s: float):
        """One frame from the doorbell or the data socket within timeout_s; None when none came
        (a doorbell the drafter closed leaves the link closed)."""
        try:
            if self.bell is not None:  # nothing to wait for: a non-blocking read (a socket timeout waits >= 1 ms)
                if timeout_s > 0:
                    frame = doorbell.receive(self.bell, timeout_s)
                else:
                    if self._scratch is None:
                        self._scratch = bytearray(doorbell.MAX_FRAME)
                    frame = doorbell.spin(self.bell, 0.0, self._scratch)
                if frame == b"":
                    self.close()
                    return None
                return frame
            if not self.sock.poll(int(timeout_s * 1000)):
                return None
            return self.sock.recv_multipart()[0]
        except (OSError, zmq.ZMQError):
            self.close()
            return None

    def _pushed(self, frame) -> None:
        """A pushed set to on_push; one that does not decode, or names another session, is dropped."""
        if self.on_push is None:
            return
        try:
            pre, session_id, _ = bound_push_from_frame(frame)
        except DrafterError:
            return
        if not self.session_id or session_id == self.session_id:
            self.on_push(pre)

    def _nbytes(self, num_tokens: int) -> int:  # what the header says follows outside the socket
        return 0

    def _before_send(self, head: wb.StepHeader) -> None:
        """The plane's work before the header goes (cuda_ipc: the "inputs ready" event)."""

    def _after_reply(self, timeout_s: float) -> None:
        """The plane's work after a StepDone with code 0 (nccl_channel: the output's recv posted)."""

    def _arrive(self) -> None:
        """The current stream waits for the drafter's output."""
        raise NotImplementedError

    def read_back(self) -> torch.Tensor:
        """The output (drafts and error word) copied into a pinned host buffer on the current
        stream, which then is synchronised: no allocation per step.  [max_batch * width + 1]."""
        if self.device.type != "cuda":
            return self.output.clone()
        if self._host_out is None:
            self._host_out = torch.empty(self.output.shape, dtype=torch.int64, pin_memory=True)
        self._host_out.copy_(self.output, non_blocking=True)
        current_stream(self.device).synchronize()
        return self._host_out

    def error_word(self) -> int:
        """The last step's error word alone (8 bytes to the host, then the current stream is
        synchronised: it waited on the drafts event, so the word is the step's)."""
        if self.device.type != "cuda":
            return int(self.output[-1])
        if self._host_word is None:
            self._host_word = torch.empty(1, dtype=torch.int64, pin_memory=True)
        self._host_word.copy_(self.output[-1:], non_blocking=True)
        current_stream(self.device).synchronize()
        return int(self._host_word[0])

    def raise_for(self, word: int) -> None:
        """INVALID_ARGUMENT naming the first field a set error word names."""
        if word:
            field = wb.first_bad_guard_field(word, self.groups)
            raise DrafterError(Code.INVALID_ARGUMENT, field, "out of range for this session (or not finite); "
                                                             "the step's rows were masked, its drafts are void")


_RECORDS = 16  # armed steps' records in flight a binding keeps (a step is settled before the next is sent)


class IpcLink(DeviceLink):
    """One cuda_ipc binding's data path, for CudaIpcBoundClient and the RemoteProposer's
    BoundTransport alike: the drafter's output opened once, the data socket, header-only steps."""

    plane = wb.CUDA_IPC

    def __init__(self, ctx: zmq.Context, slabs, device: torch.device, resp: wb.BindResponse, max_batch: int,
                 groups: int, inputs_event, via: str = "", host_wait: bool = False):
        """inputs_event: this side's "inputs ready" event (its handle went in the BindRequest);
        host_wait: the host waits for the drafts event (cudaEventSynchronize) where the current
        stream would wait on it (same_gpu: the better of the two where both run on one GPU).
        DrafterError naming output.* when the drafter's output cannot be opened here."""
        self.slabs, self.inputs_event, self.host_wait = slabs, inputs_event, host_wait
        width = resp.drafts_width
        self.armed = resp.armed
        ref = cuda_slab.check_ref(resp.output, "output", wb.arm_words(max_batch, width, self.armed) * 8)
        out = slabs.open(ref, device, "output").view(torch.int64)  # [words]
        self.output = out[:max_batch * width + 1]  # [max_batch * width + 1]: drafts..., error word
        self.drafts_event = slabs.open_event(resp.drafts_event, device, "output")
        self._events = (self.drafts_event,)  # the step's "drafts ready" event: by the step's parity where armed
        if self.armed:
            self._arm_row = out[out.numel() - wb.ARM_WORDS:]  # [ARM_WORDS] int64, the drafter's memory
            self._events = (self.drafts_event, slabs.open_event(resp.drafts_event_odd, device, "output"))
            pin = device.type == "cuda"
            # a ring of records (each copied when its copy runs: a slot is rewritten RECORDS steps later)
            self._records = torch.zeros(_RECORDS, wb.ARM_WORDS, dtype=torch.int64, pin_memory=pin)
            self._records_np = self._records.numpy()
            self._go_np = self._records_np.view(np.uint32)[:, 2 * wb.ARM_GO:2 * wb.ARM_GO + 2]  # [RECORDS, 2]
            # the copies' addresses, once: a step then makes two driver calls and no torch call
            row, rec = self._arm_row.data_ptr(), self._records.data_ptr()
            self._arm_dst = (row + 8 * wb.ARM_STEP, row + 8 * wb.ARM_GO)
            self._arm_src = [(rec + 64 * i + 8 * wb.ARM_STEP, rec + 64 * i + 8 * wb.ARM_GO) for i in range(_RECORDS)]
        self._torch = isinstance(slabs, cuda_slab.TorchSlabs)  # CUDA events: on the current stream directly
        self._setup(ctx, device, resp, groups, via)

    def _copy_record(self, slot: int) -> None:
        """Queue the record's copy, then the go words', from the pinned slot into the drafter's arm row."""
        stream = current_stream(self.device).cuda_stream
        (dst_rec, dst_go), (src_rec, src_go) = self._arm_dst, self._arm_src[slot]
        stream_ops.copy_to_device(stream, dst_rec, src_rec, 8 * wb.ARM_RECORD)
        stream_ops.copy_to_device(stream, dst_go, src_go, 8)  # the two go words

    def _before_send(self, head: wb.StepHeader) -> None:
        if self.armed:
            self._start(head)
        elif self._torch:
            self.inputs_event.record(current_stream(self.device))
        else:
            self.slabs.record(self.inputs_event, self.device)

    def _start(self, head: wb.StepHeader) -> None:
        """An armed step started from this GPU (wb.ARM_WORDS): after the inputs, on the current
        stream, the step's record and then its two go words copied into the drafter's arm row."""
        slot = head.step % _RECORDS
        words = self._records_np[slot]  # the pinned slot's memory, written without a torch call
        words[wb.ARM_STEP:wb.ARM_STEP + wb.ARM_RECORD] = (head.step, head.num_tokens, head.batch,
                                                          head.batch_padded, head.tokens_padded)
        self._go_np[slot] = head.step & 0xFFFFFFFF  # both go words (uint32 halves of word ARM_GO)
        if self._torch:  # the record, then the go word (4 bytes): each lands before the next copy starts
            if torch.cuda.current_device() != self.device.index:  # the driver calls need this GPU's context
                with torch.cuda.device(self.device):
                    self._copy_record(slot)
            else:
                self._copy_record(slot)
            return
        rec, row = self._records[slot], self._arm_row  # [ARM_WORDS] int64 each
        self.slabs.copy_words(row[wb.ARM_STEP:wb.ARM_STEP + wb.ARM_RECORD],
                              rec[wb.ARM_STEP:wb.ARM_STEP + wb.ARM_RECORD], self.device)
        self.slabs.copy_words(row[wb.ARM_GO:wb.ARM_GO + 1], rec[wb.ARM_GO:wb.ARM_GO + 1], self.device)

    def _arrive(self) -> None:
        """The "drafts ready" event waited for: by the host (host_wait; the time counts as waiting,
        not as host work), else by the current stream."""
        event = self._events[self.last_step % len(self._events)]
        if self.host_wait:
            t0 = time.perf_counter_ns()
            self.slabs.synchronize(event)
            self._waited_ns += time.perf_counter_ns() - t0
        elif self._torch:
            event.wait(current_stream(self.device))
        else:
            self.slabs.wait(event, self.device)


class CudaIpcBoundClient:
    def __init__(self, endpoint: str, layout: schema.AttachRequest, buffers: list[wb.BufferSpec], *,
                 max_batch: int, device="cuda", transport: str = "tcp", timeout_s: float = 5.0,
                 allow_fallback: bool = True, force_ring: bool = False, slabs=None, host_wait: bool | None = None,
                 channel: bool = False, doorbell: bool = True, spin_us: int = 0, armed: bool = True,
                 curve=None):
        """slabs: drafter.wire.cuda_slab's TorchSlabs (default) or LocalSlabs (one process, the tests);
        force_ring: bind the host ring even where CUDA IPC would do (to compare the planes);
        channel: bind the nccl_channel plane instead of cuda_ipc (the drafter on another GPU of this
        host or on another host: coordinator.transport.bound_channel), the host ring where the
        drafter refuses it and allow_fallback;
        host_wait: a cuda_ipc step waits for the drafter's event on the host (cudaEventSynchronize)
        before queueing its read, so nothing of this context waits on the GPU while the drafter's
        kernels run, instead of making the stream wait on it; None (the default): where the
        drafter's engine is on this GPU (same_gpu: two contexts time-slicing one GPU);
        doorbell: cuda_ipc steps by the binding's same-host doorbell (drafter.wire.doorbell) where the
        drafter offers one and it can be reached, else (and with False) by the data socket;
        spin_us: with the doorbell, how long the drafter polls it for the next header after each
        reply before its thread sleeps (BindRequest.spin_us: for steps that come back to back);
        armed: cuda_ipc steps started from this GPU (BindRequest.armed, drafter.wire.bound.ARM_WORDS:
        the drafter queues each next step ahead behind a GPU wait for the go word this side copies
        after its inputs), where the drafter grants it (the default; False: the drafter's host starts
        each step at its header);
        curve: a coordinator.transport.zmq_client.CurveConfig for a drafter whose ZMQ has CURVE: every
        socket of this client (control, data) takes its keys."""
        self.endpoint, self.layout, self.buffers = endpoint, layout, list(buffers)
        self.max_batch, self.transport, self.timeout_s = max_batch, transport, timeout_s
        self.allow_fallback, self.force_ring, self.host_wait = allow_fallback, force_ring, host_wait
        self.channel, self.doorbell, self.spin_us = channel, doorbell, spin_us if doorbell else 0
        self.armed = armed
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.slabs = slabs or cuda_slab.TorchSlabs()
        self.slots, total = wb.ring_layout(self.buffers, lambda d: DTYPES[d].itemsize)
        self.slab = torch.zeros(total, dtype=torch.uint8, device=self.device)  # [total]: the shared buffers
        self.views = {s.name: self.slab[s.offset:s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape)
                      for s in self.slots}
        self.groups = len(layout.kv_groups)
        self.ctx = zmq.Context()
        if curve is not None:
            curve.apply_to_context(self.ctx)
        self.control = self._socket(endpoint, data=False)
        self.link: DeviceLink | None = None  # the cuda_ipc (IpcLink) or nccl_channel (ChannelLink) data path
        self.session: schema.AttachResponse | None = None
        self.plane = ""  # after bind: wb.CUDA_IPC, wb.NCCL_CHANNEL or wb.HOST_RING
        self.fallback_reason = ""
        self.ring = None  # the host-ring fallback (a HostRingClient)
        self.binds = 0
        self.width = 0
        self._inputs_event = self._inputs_handle = None
        self._calls = itertools.count(1)
        self._on_push = None  # pushed pre-drafts (on_push)
        self._min_hits = 0.0  # predraft_min_hits
        self.host_ns = 0  # the last cuda_ipc step's host time on this side, the wait for the reply excluded
        # the last cuda_ipc step's perf_counter_ns on both sides (CLOCK_MONOTONIC, one host): "sent",
        # the drafter's wb.STAMPS, "answered" (the reply read), and after step() "read" (drafts on the host)
        self.stamps: dict[str, int] = {}

    @property
    def data(self) -> zmq.Socket | None:  # the cuda_ipc binding's data socket, while it lives
        return self.link.sock if self.link is not None and self.link.alive else None

    @property
    def output(self) -> torch.Tensor:  # [max_batch * width + 1] int64 on the GPU: the drafts, the error word
        return self.link.output

    # ------------------------------------------------------------------ control
    def _socket(self, endpoint: str, data: bool) -> zmq.Socket:
        return connect_socket(self.ctx, endpoint, data=data)

    def _call(self, method: str, body, decoder, deadline: float):
        return control_call(self.control, next(self._calls), method, body, decoder, deadline, self.timeout_s)

    def bind(self) -> str:
        """Attach and bind over CUDA IPC (or the nccl_channel where asked), or fall back to the host
        ring; the plane in use."""
        self.unbind()
        deadline = time.monotonic() + self.timeout_s
        self.session = self._call("Attach", msgspec.structs.replace(self.layout, cuda_ipc_capable=True), _ATTACH,
                                  deadline)
        try:
            return self._bind_attached(deadline)
        except BaseException:  # the attached session goes back: a failed bind holds no KV blocks
            self._detach(time.monotonic() + self.timeout_s)
            if self.ring is not None and self.ring.session is not None:  # the fallback's own session too
                try:
                    self.ring.detach()
                except DrafterError:
                    self.ring.unbind()  # it expires on the drafter's side
            self.unbind()
            raise

    def _bind_attached(self, deadline: float) -> str:
        """bind() after the Attach: the plane asked for, or the host ring (allow_fallback)."""
        want = wb.NCCL_CHANNEL if self.channel else wb.CUDA_IPC
        if self.force_ring:
            why = "force_ring"
        elif self.channel:
            why = "" if self.device.type == "cuda" or channel_backend() == "gloo" else "the slab is not on a GPU"
        else:
            why = cannot_share(self.slabs, self.device, self.session.cuda_ipc)
        if not why:
            try:
                self._bind_channel(deadline) if self.channel else self._bind_ipc(deadline)
                self.binds += 1
                return self.plane
            except DrafterError as err:
                if err.field not in ENVIRONMENT and not (self.channel and err.field in channel_refusals()):
                    raise
                why = f"the drafter refused {err.field}: {err.message}"
        if not self.allow_fallback and not self.force_ring:
            raise DrafterError(Code.FAILED_PRECONDITION, "plane", f"{want} is not possible: {why}")
        self._detach(deadline)
        self._bind_ring(why)
        self.binds += 1
        return self.plane

    def _bind_ipc(self, deadline: float) -> None:
        if self._inputs_event is None:
            self._inputs_event, self._inputs_handle = self.slabs.new_event(self.device)
        slab = self.slabs.share(self.slab, self._inputs_handle)
        req = wb.BindRequest(session_id=self.session.session_id, epoch=self.session.epoch, plane=wb.CUDA_IPC,
                             transport=self.transport, buffers=self.buffers, max_batch=self.max_batch, slab=slab,
                             doorbell=self.doorbell, spin_us=self.spin_us, armed=self.armed)
        resp = self._bind_call(req, deadline)
        self.width = resp.drafts_width
        wait = same_gpu(self.session.cuda_ipc, self.device) if self.host_wait is None else self.host_wait
        link = IpcLink(self.ctx, self.slabs, self.device, resp, self.max_batch, self.groups, self._inputs_event,
                       via=self.endpoint, host_wait=wait)
        if not link.connect(deadline - time.monotonic()):
            link.close()
            self.unbind()
            raise DrafterError(Code.DEADLINE_EXCEEDED, "", f"the data socket {resp.endpoint} did not connect")
        if self.doorbell:
            link.open_doorbell(deadline - time.monotonic())
        link.on_push, link.session_id, link.predraft_min_hits = self._on_push, self.session.session_id, self._min_hits
        self.link = link
        self.plane = wb.CUDA_IPC

    def _bind_call(self, req: wb.BindRequest, deadline: float) -> wb.BindResponse:
        """The Bind; asked again without the fields a drafter from before them refuses as unknown
        (armed, then the doorbell: such a drafter starts each step at its header, on the data socket)."""
        while True:
            try:
                return self._call(wb.BIND_METHOD, req, wb.BIND_RESPONSE_DECODER, deadline)
            except DrafterError as err:
                if req.armed and knows_no_armed(err):
                    req = msgspec.structs.replace(req, armed=False)
                elif req.doorbell and knows_no_doorbell(err):
                    req = msgspec.structs.replace(req, doorbell=False, spin_us=0)
                else:
                    raise

    def _bind_channel(self, deadline: float) -> None:
        """Bind the nccl_channel plane (this GPU named: NCCL refuses two ranks on one GPU) and join its group."""
        from coordinator.transport.bound_channel import ChannelLink

        uuid = cuda_ref.device_uuid(self.device) if self.device.type == "cuda" else ""
        resp = self._bind_call(wb.BindRequest(
            session_id=self.session.session_id, epoch=self.session.epoch, plane=wb.NCCL_CHANNEL,
            transport=self.transport, buffers=self.buffers, max_batch=self.max_batch, device_uuid=uuid,
            doorbell=self.doorbell, spin_us=self.spin_us), deadline)
        self.width = resp.drafts_width
        link = ChannelLink(self.ctx, self.device, resp, self.max_batch, self.groups, self.slab, self.slots,
                           via=self.endpoint)
        try:
            ready = link.connect(deadline - time.monotonic(), self.timeout_s)
        except DrafterError:
            link.close()
            raise
        if not ready:
            link.close()
            self.unbind()
            raise DrafterError(Code.DEADLINE_EXCEEDED, "", f"the data socket {resp.endpoint} did not connect")
        if self.doorbell:
            link.open_doorbell(deadline - time.monotonic())
        self.link = link
        self.plane = wb.NCCL_CHANNEL

    def _bind_ring(self, why: str) -> None:
        from coordinator.transport.bound_client import HostRingClient

        self.fallback_reason = why
        if self.ring is None:
            self.ring = HostRingClient(self.endpoint, self.layout, self.buffers, max_batch=self.max_batch,
                                       transport=self.transport, timeout_s=self.timeout_s)
        self.ring.bind()
        self.plane = wb.HOST_RING

    def _detach(self, deadline: float) -> None:
        """Give the attached session's blocks back (the fallback attaches its own)."""
        if self.session is None:
            return
        try:
            self._call("Detach", schema.DetachRequest(session_id=self.session.session_id, epoch=self.session.epoch),
                       _DETACH, deadline)
        except DrafterError:
            pass  # it expires on the drafter's side
        self.session = None

    def detach(self) -> None:
        """Give the session back to the drafter (its KV blocks with it) and forget the binding."""
        deadline = time.monotonic() + self.timeout_s
        if self.plane == wb.HOST_RING and self.ring is not None and self.ring.session is not None:
            self.session, self.ring.session = self.ring.session, None
            self.ring.unbind()
        self._detach(deadline)
        self.unbind()

    def unbind(self) -> None:
        if self.link is not None:
            self.link.close()
        self.link, self.session, self.plane = None, None, ""

    def close(self) -> None:
        if self.control.closed:
            return
        if self.ring is not None:
            self.ring.close()
        self.unbind()
        self.control.close(linger=0)
        self.ctx.term()

    # ------------------------------------------------------------------ steps
    def step(self, num_tokens: int, batch: int, batch_padded: int = 0, tokens_padded: int = 0,
             accepted_counts: list[int] | None = None, want_predrafts: bool = False) -> torch.Tensor:
        """Draft for the rows the target wrote into the views; [batch, width] int64 on the host.
        accepted_counts: [batch] (-1: none) of the previous step, the drafter's metrics and, with
        want_predrafts (cuda_ipc, nccl_channel), what its pre-drafts read the outcome from."""
        if not self.plane:
            self._bind_in_step()
        if self.plane == wb.HOST_RING:
            self.stamps = {}
            return self._ring_step(num_tokens, batch, batch_padded, tokens_padded)
        self.step_async(num_tokens, batch, batch_padded, tokens_padded, accepted_counts,
                        want_predrafts)  # the host waits in it where host_wait
        host = self.link.read_back()  # [max_batch * width + 1]: the drafts and the error word, one copy
        self.stamps["read"] = time.perf_counter_ns()
        self.link.raise_for(int(host[-1]))
        return host[:batch * self.width].view(batch, self.width).clone()  # the buffer is the next step's

    def step_async(self, num_tokens: int, batch: int, batch_padded: int = 0, tokens_padded: int = 0,
                   accepted_counts: list[int] | None = None, want_predrafts: bool = False) -> torch.Tensor:
        """The cuda_ipc step without a host read: [batch, width] int64 on the GPU, which the current
        stream's later work sees; check() tells whether the step was in range."""
        self._device_plane()
        drafts = self._live(lambda: self.link.step_async(num_tokens, batch, batch_padded, tokens_padded,
                                                         self.timeout_s, accepted_counts, want_predrafts))
        self.host_ns, self.stamps = self.link.host_ns, self.link.stamps
        return drafts

    def _device_plane(self) -> None:
        """Bound (binding now where not yet) over cuda_ipc or nccl_channel, else FAILED_PRECONDITION."""
        if not self.plane:
            self._bind_in_step()
        if self.plane not in (wb.CUDA_IPC, wb.NCCL_CHANNEL):
            raise DrafterError(Code.FAILED_PRECONDITION, "plane", f"bound over {self.plane}: use step()")

    # ------------------------------------------------------------------ pushed pre-drafts (issue 23)
    @property
    def on_push(self):
        """Called with each pushed pre-draft set (drafter.wire.predraft.PreDrafts) of this binding."""
        return self._on_push

    @on_push.setter
    def on_push(self, fn) -> None:
        self._on_push = fn
        if self.link is not None:
            self.link.on_push = fn

    @property
    def predraft_min_hits(self) -> float:
        """The pick's rule told to the drafter with each step that asks (StepHeader.predraft_min_hits)."""
        return self._min_hits

    @predraft_min_hits.setter
    def predraft_min_hits(self, share: float) -> None:
        self._min_hits = share
        if self.link is not None:
            self.link.predraft_min_hits = share

    def step_nowait(self, num_tokens: int, batch: int, batch_padded: int = 0, tokens_padded: int = 0,
                    accepted_counts: list[int] | None = None, want_predrafts: bool = True) -> int:
        """A step the target does not wait for (DeviceLink.send_nowait): call settle() before
        writing the views again.  The step's number (the key of the pre-drafts it is pushed)."""
        self._device_plane()
        return self._live(lambda: self.link.send_nowait(num_tokens, batch, batch_padded, tokens_padded,
                                                        self.timeout_s, accepted_counts, want_predrafts))

    def settle(self) -> None:
        """Before writing the views: the StepDone of a step sent by step_nowait read, and this
        side's later work ordered after the drafter's reads (DeviceLink.settle)."""
        if self.link is not None and self.link.alive:
            self._live(lambda: self.link.settle(self.timeout_s))

    def poll_pushes(self, timeout_s: float = 0.0, until=None) -> None:
        """Read the pre-draft sets pushed so far (to on_push), waiting at most timeout_s or until until()."""
        if self.link is not None and self.link.alive:
            self.link.poll_pushes(timeout_s, until)

    @property
    def last_step(self) -> int:
        """The binding's last step number (0 before the first; a new binding counts from 1 again)."""
        return self.link.last_step if self.link is not None else 0

    def _live(self, fn):
        """fn() on the link; a link it left in doubt is dropped, and one whose drafter went away
        (nothing sent) is bound again at once (that step then refused: FAILED_PRECONDITION)."""
        link = self.link
        try:
            return fn()
        except DrafterError as exc:
            if not link.alive:
                self.unbind()
                if exc.code == Code.UNAVAILABLE and exc.field == "data":
                    self._bind_in_step()
            raise

    def check(self) -> None:
        """Read the last step's error word (a host sync); INVALID_ARGUMENT naming its first field."""
        self.link.raise_for(int(self.output[-1].item()))

    def _bind_in_step(self) -> None:
        first = self.binds == 0
        self.bind()
        if not first:
            raise DrafterError(Code.FAILED_PRECONDITION, "session",
                               "bound again (the drafter restarted or forgot the session): resend the context")

    def _ring_step(self, num_tokens: int, batch: int, batch_padded: int, tokens_padded: int) -> torch.Tensor:
        """The fallback: the ring's step from the slab (its used prefix to the ring's pinned slab by
        device-to-host copies, on the ring stream in chunks sent as each lands)."""
        if self.device.type != "cuda":
            nbytes = wb.step_bytes(self.slots, num_tokens)
            pinned_slab(self.ring)[:nbytes].copy_(self.slab[:nbytes])
            return self.ring.step(num_tokens, batch, batch_padded, tokens_padded)
        return self.ring.step(num_tokens, batch, batch_padded, tokens_padded, source=self.slab)


def same_gpu(support, device: torch.device) -> bool:
    """Whether the drafter's engine runs on `device` (its CudaIpcSupport names its own GPU first,
    drafter.service.cuda_support.readable_devices): then two contexts time-slice one GPU, and the
    target's host waiting for the drafts beats its stream waiting on the drafter's event
    (bench/results/2026-11-26-h200x2-bound-doorbell-spin, one/: 1.10-1.22x against 1.39-1.48x)."""
    if device.type != "cuda" or support is None or not support.enabled or not support.device_uuids:
        return False
    return support.device_uuids[0] == cuda_ref.device_uuid(device)


def knows_no_armed(err: DrafterError) -> bool:
    """Whether a Bind refusal is a drafter's that does not know BindRequest.armed: bind again without it."""
    return err.code == Code.INVALID_ARGUMENT and err.field == "body" and "armed" in err.message


def knows_no_doorbell(err: DrafterError) -> bool:
    """Whether a Bind refusal is a drafter's that does not know BindRequest.doorbell (its decoder
    refuses the unknown field): bind again without it."""
    return err.code == Code.INVALID_ARGUMENT and err.field == "body" and (
        "doorbell" in err.message or "spin_us" in err.message)


def channel_backend() -> str:
    """The nccl_channel's group backend (coordinator.transport.bound_channel.BACKEND)."""
    from coordinator.transport import bound_channel

    return bound_channel.BACKEND


def channel_refusals() -> tuple[str, ...]:
    """The fields of a Bind refusal that mean the drafter cannot serve the nccl_channel here."""
    from coordinator.transport import bound_channel

    return bound_channel.REFUSED


def pinned_slab(client) -> torch.Tensor:
    """A HostRingClient's slab ([ring bytes] uint8, pinned where CUDA is)."""
    ring = getattr(client, "ring", None)
    return ring.slab if ring is not None and hasattr(ring, "slab") else client.slab
