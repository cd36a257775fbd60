"""The RemoteProposer's ZMQ transport with a bound session under it (drafter.wire.bound).

    transport = bindable(ServiceTransport(ep), spec, BoundConfig())   # what RemoteProposer does over ZMQ
    info = transport.attach(spec, timeout)           # Attach, then Bind the session's ring
    out = transport.request_drafts(info, request, timeout)   # bound step, or the unbound Propose

The transport owns ring-backed buffers (coordinator.transport.bound_client.BoundRing) sized for the
session: every int buffer int64 (a copy from int32 or int64 is exact), the hidden states in the
session's dtype, block tables as wide as max_model_len (plus tree nodes) needs, token rows for a
decode step of every sequence (max_num_seqs * (k + 1)) unless BoundConfig.max_tokens says more.
Each step copies the request's tensors into the ring, one copy per tensor (fill_s records the
host time of those copies), and ships the ring's prefix; no tensor of the caller's is lent to the
wire, so the caller may refill its buffers as soon as the call returns.  GPU inputs are copied
into a mirror of the ring on their GPU (device copies, queued), whose used prefix the link then
copies to the pinned host ring: on the binding's ring stream in chunks, each sent as it lands
(BoundLink.step's source), else in one copy and one stream sync.  A caller may write its hidden
states straight into the buffer a step fills from (hidden_rows; the vLLM plugin's EAGLE-3 layers,
drafter_vllm.hidden), which saves their copy.

The plane (BoundConfig.plane "auto", the default): cuda_ipc where the caller's tensors are on a
GPU the drafter advertises CUDA IPC for (this host, that GPU: coordinator.transport.bound_ipc.
cannot_share, as CudaIpcBoundClient decides; the drafter's CudaIpcSupport is asked for by an Info
at attach), the host ring otherwise.  Over cuda_ipc the ring's layout lies in a slab on the
caller's GPU, shared with the drafter once at Bind; a step copies the request's tensors into it
(one device copy per tensor, on the current stream), records the "inputs ready" event and sends
the header alone (coordinator.transport.bound_ipc.IpcLink; on the binding's same-host doorbell where
the drafter offers one and it answers within DOORBELL_CONNECT_S, else on the data socket; a drafter
that does not know the Bind's doorbell field is asked again without; where the drafter's engine is
on the caller's GPU the host waits for its drafts event rather than the stream, bound_ipc.same_gpu);
the drafts come back as a GPU tensor
(a copy of the drafter's output queued on the current stream after its wait on the "drafts ready"
event), and the step's one host read is its error word (8 bytes, one stream sync): a set word is
INVALID_ARGUMENT naming the field, as CudaIpcBoundClient reports it.  Where the tensors live is
learnt from the steps (BoundConfig.device says it at attach instead): a binding made before, on
the host ring, is replaced by a cuda_ipc one at the first GPU step, which itself goes unbound
(exact) until the new binding is connected.  A drafter that refuses the slab or whose output
cannot be opened here (another container, no --allow-cuda-ipc) leaves the host ring in use.

Chosen at attach from what both sides can do: the Bind goes out on its own control socket right
after Attach and is waited for within what is left of the attach's budget; a reply that comes
later is picked up by a later step (until then steps go unbound on the same session).  The drafter
refusing the Bind (no graphs, a layout it cannot read, a ring over its message limit, no ipc
socket) leaves the session unbound, once, with a warning; `BoundConfig(mode="off")` never binds.

A step goes bound when the binding is live and the request fits the ring exactly (greedy, no
draft probabilities, no CUDA IPC reference, no pre-drafts asked for, the session's hidden dtype,
integer tensors, rows within the ring's, block tables at least as wide); anything else goes by
the unbound Propose, which validates it in full (exact or refused, as without a binding).  A
bound step's header carries the request's accepted_counts (a list: a GPU tensor is read to the
host for it), which the drafter's acceptance metrics count; without them a bound step is not
counted (the unbound Propose derives counts from num_rejected_tokens).
Failing closed:
  * a data socket without a live connection (the drafter or the binding went away; nothing was
    sent): the step goes unbound on the same session, which either drafts (the drafter lives; a
    new Bind is asked for) or tells the RemoteProposer the session is gone (re-attach, re-bind);
  * a bound step's refusal or timeout raises DrafterError as the unbound call would; the
    RemoteProposer's deadline, breaker and re-attach handle it as they handle the unbound call.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import deque
from dataclasses import dataclass, replace

import msgspec
import torch
import zmq

from coordinator.transport.bound_client import (REBIND, STREAM_LANES, BoundLink, BoundRing, connect_socket,
                                                knows_no_stream)
from coordinator.transport.bound_channel import REFUSED as CHANNEL_REFUSED
from coordinator.transport.bound_channel import ChannelLink
from coordinator.transport.bound_ipc import (ENVIRONMENT, DeviceLink, IpcLink, cannot_share, knows_no_armed,
                                            knows_no_doorbell, same_gpu)
from drafter.wire import cuda_ref
from drafter.wire import bound as wb
from drafter.wire import cuda_slab, schema
from drafter.wire.errors import Code, DrafterError
from drafter.wire.records import DraftOutput, ProposeInputs, ProposeRequest
from drafter.wire.tensors import DTYPE_NAMES, DTYPES

log = logging.getLogger("coordinator.bound")

MODES = ("auto", "off")
DATA_TRANSPORTS = ("auto", "tcp", "ipc")
AUTO = "auto"  # the plane: cuda_ipc where the caller's tensors are on a GPU the drafter reads, else
# nccl_channel for tensors on a GPU (the drafter refusing it: host_ring), else host_ring
PLANES = (AUTO, *wb.PLANES)
SLABS = None  # the cuda_ipc plane's backend; None: cuda_slab.TorchSlabs (the CPU tests put a LocalSlabs here)
_ENVELOPE = msgspec.msgpack.Decoder(schema.Envelope)
_INFO = msgspec.msgpack.Decoder(schema.InfoResponse)
_INT = (torch.int32, torch.int64)
_OPTIONAL = ("token_indices_to_sample", "num_rejected_tokens")
_SMALL_BYTES = 1 << 20  # room kept under the drafter's message limit for everything but the hidden rows
BIND_RETRY_S = 5.0  # a Bind unanswered this long is sent again (its late reply is skipped by call id)


@dataclass(frozen=True)
class BoundConfig:
    mode: str = "auto"  # auto: bind when the drafter can; off: the unbound Propose only
    transport: str = "auto"  # the data socket: auto = ipc for a drafter on loopback (tcp if it has none)
    # auto (or cuda_ipc): cuda_ipc where the caller's tensors are on a GPU the drafter reads over CUDA
    # IPC, else nccl_channel for tensors on a GPU (host_ring once the drafter refused it), else
    # host_ring; host_ring, gloo_channel or nccl_channel: that plane always
    plane: str = AUTO
    max_tokens: int = 0  # the ring's token rows; 0: max_num_seqs * (k + 1), within max_num_batched_tokens
    channel_timeout_s: float = 5.0  # gloo_channel, nccl_channel: joining (and gloo's each step's send)
    device: str = ""  # where the caller's tensors live, to bind the right plane at attach; "": learnt from the steps
    # cuda_ipc: each step started from the caller's GPU (BindRequest.armed, drafter.wire.bound.ARM_WORDS: the
    # drafter queues the next step ahead behind a GPU wait for the go word the caller copies after its
    # inputs), where the drafter grants it; False: the drafter's host starts each step at its header
    armed: bool = True

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"bound mode must be one of {MODES}, got {self.mode!r}")
        if self.transport not in DATA_TRANSPORTS:
            raise ValueError(f"bound transport must be one of {DATA_TRANSPORTS}, got {self.transport!r}")
        if self.plane not in PLANES:
            raise ValueError(f"bound plane must be one of {PLANES}, got {self.plane!r}")
        if self.device:
            try:
                torch.device(self.device)
            except RuntimeError as exc:
                raise ValueError(f"bound device {self.device!r}: {exc}") from None
        if self.max_tokens < 0 or not self.channel_timeout_s > 0:
            raise ValueError("bound max_tokens must be >= 0 and channel_timeout_s positive")


def bindable(transport, spec, cfg: BoundConfig):
    """transport with a bound session under it where it speaks ZMQ and cfg allows; else itself."""
    client = getattr(transport, "client", None)
    if cfg.mode == "off" or getattr(transport, "name", "") != "zmq" or not hasattr(client, "endpoint"):
        return transport
    return BoundTransport(transport, spec, cfg)


@dataclass
class _Pending:
    """A Bind sent and not answered yet."""

    call_id: int
    session_id: str
    epoch: int
    transport: str
    sent_at: float  # time.monotonic(): unanswered after BIND_RETRY_S, the Bind is sent again
    plane: str


DOORBELL_CONNECT_S = 0.1  # at least this long for the doorbell's hello to be answered (once a binding)


class BoundTransport:
    """DraftTransport: the unbound ZMQ transport `inner` for attach, detach and what does not fit,
    and a bound session for the steps that do."""

    def __init__(self, inner, spec, cfg: BoundConfig):
        self.inner, self.spec, self.cfg = inner, spec, cfg
        self.endpoint = inner.client.endpoint
        curve = getattr(inner.client, "curve", None)  # the ZMQ client's CURVE keys: every bound socket's too
        self._own_ctx = curve is not None
        self.ctx = zmq.Context() if curve is not None else zmq.Context.instance()
        if curve is not None:
            curve.apply_to_context(self.ctx)
        self.control: zmq.Socket | None = None  # Bind's own socket: its reply may come during a later step
        self.ring: BoundRing | None = None
        self._mirror: BoundRing | None = None  # the ring's layout on the inputs' GPU
        self.link: BoundLink | None = None
        self.bound_to = ""  # the session the live link serves
        self.last_bound = False  # whether the last step went bound (names the latency series)
        self.fill_s: deque[float] = deque(maxlen=4096)  # host seconds of each bound step's copies into the ring
        # the last cuda_ipc step's host stages, perf_counter_ns: start, filled, answered (the link's step_async
        # returned: header sent, StepDone read, the drafts event waited for), cloned, checked (error word read)
        self.ipc_marks: tuple[int, ...] = ()
        self.steps = {"bound": 0, "unbound": 0}
        self._pending: _Pending | None = None
        self._connecting: tuple[BoundLink, str] | None = None
        self._refused = ""  # a session whose Bind the drafter refused: not asked again
        self._tree_nodes = 0
        self._max_message_bytes = 0
        self._calls = 0
        self._device: torch.device | None = _device(cfg.device) if cfg.device else None  # the caller's tensors'
        self._planes: dict[torch.device, str] = {}  # the plane for the caller's tensors on each device
        self._support = None  # the drafter's CudaIpcSupport (its AttachResponse's, or asked by Info)
        self._armed = cfg.armed  # cuda_ipc Binds ask for armed steps (False once a drafter did not know the field)
        self._doorbell = True  # cuda_ipc and nccl_channel Binds ask for the doorbell (False once a drafter did not
        # know the field)
        self._stream = True  # host_ring Binds ask for the ring stream (False once a drafter did not know the field)
        self._ipc_refused = ""  # why the drafter refused or could not serve a cuda_ipc binding: host ring since
        self._nccl_refused = ""  # why the drafter refused or could not serve an nccl_channel binding
        self._slabs = None  # the cuda_ipc backend (SLABS or TorchSlabs)
        self._slab: BoundRing | None = None  # cuda_ipc: the ring's layout on the caller's GPU, shared with the drafter
        self._events: dict[torch.device, tuple] = {}  # cuda_ipc: device -> ("inputs ready" event, its handle)
        self._max_batch = 0  # the last Bind's max_batch (the rows of the drafter's output)

    @property
    def name(self) -> str:
        return "zmq-bound" if self.last_bound else self.inner.name

    # ------------------------------------------------------------------ DraftTransport
    def attach(self, spec, timeout: float):
        """Attach (the unbound transport), then ask for a binding and wait for it within the rest of timeout."""
        until = time.monotonic() + timeout
        self._forget()
        info = self.inner.attach(spec, timeout)
        resp = getattr(getattr(self.inner.client, "session", None), "attach", None)
        if resp is not None:
            self._tree_nodes = len(resp.speculative_token_tree or [])
            self._max_message_bytes = resp.limits.max_message_bytes if resp.limits else 0
        self._support = getattr(resp, "cuda_ipc", None) or self._ask_support(until)
        self._planes.clear()
        self._ask(info)
        self._advance(info, until)
        return info

    def request_drafts(self, session, request: ProposeRequest, timeout: float) -> DraftOutput:
        """One step: bound when the binding is live and the request fits it, else unbound."""
        deadline = time.monotonic() + timeout
        hidden = request.inputs.target_hidden_states
        if hidden is not None and hidden.device != self._device:
            self._device = hidden.device
        if self.bound_to != session.session_id or self.link is None or not self.link.alive \
                or self.link.plane != self._plane():
            self._ask(session)
            self._advance(session, 0.0)
        self.last_bound = False
        if self.link is not None and self.link.alive and self.bound_to == session.session_id \
                and fits(self.ring, request, len(self.spec.kv_groups)):  # the ring's buffers are the slab's
            try:
                out = self._bound_step(request, deadline)
                self.last_bound = True
                return out
            except DrafterError as exc:
                if not (exc.code == Code.UNAVAILABLE and exc.field == "data"):
                    raise
                log.info("bound session %s: its data socket went away; this step goes unbound", session.session_id)
        self.steps["unbound"] += 1
        return self.inner.request_drafts(session, private(request), max(1e-3, deadline - time.monotonic()))

    def detach(self, session, timeout: float) -> None:
        self._forget()
        self.inner.detach(session, timeout)

    def close(self) -> None:
        self._forget()
        if self.control is not None:
            self.control.close(linger=0)
            self.control = None
        if self._own_ctx:  # the CURVE context: every link's socket goes with it
            self.ctx.destroy(linger=0)
        self.inner.close()

    # ------------------------------------------------------------------ the bound step
    def _bound_step(self, request: ProposeRequest, deadline: float) -> DraftOutput:
        accepted = request.accepted_counts.tolist() if request.accepted_counts is not None else None
        if isinstance(self.link, DeviceLink):  # cuda_ipc or nccl_channel: the slab on the caller's GPU
            return self._ipc_step(request, accepted, deadline)
        t0 = time.perf_counter()
        device = request.inputs.target_hidden_states.device
        source = None
        if device.type == "cuda":  # copies on the GPU; the link copies the used prefix to the host ring
            n, b = fill(self._mirror_on(device).views, request.inputs)  # (on the ring stream in chunks)
            source = self._mirror.slab
        else:
            n, b = fill(self.ring.views, request.inputs)
        self.fill_s.append(time.perf_counter() - t0)
        self.steps["bound"] += 1
        drafts = self.link.step(n, b, request.batch_padded, request.tokens_padded,
                                max(1e-3, deadline - time.monotonic()), accepted, source)
        return DraftOutput(drafts, None, request.batch_padded, request.tokens_padded)

    def _mirror_on(self, device: torch.device) -> BoundRing:
        """The host ring's layout on the inputs' GPU (kept while the layout and device stay)."""
        if self._mirror is None or self._mirror.buffers != self.ring.buffers or self._mirror.slab.device != device:
            self._mirror = BoundRing(self.ring.buffers, device=device)
        return self._mirror

    def hidden_rows(self, num_tokens: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """[num_tokens, width] rows of the hidden-states buffer the next bound step fills from on
        `device` (the cuda_ipc or nccl_channel slab, the host ring's GPU mirror, or the host ring),
        for a caller that writes its hidden states there itself: fill's copy of them then has
        nothing to do (torch's copy_ leaves a view of the same memory alone).  None where the
        binding is not live, or the buffer is elsewhere, of another dtype or width, or too short."""
        if self.link is None or not self.link.alive or self.ring is None:
            return None
        if isinstance(self.link, DeviceLink):
            buf = self._slab
        else:
            buf = self._mirror_on(device) if device.type == "cuda" else self.ring
        view = buf.views[wb.HIDDEN] if buf is not None and buf.slab.device == device else None
        if view is None or view.dtype != dtype or view.shape[1] != width or not 0 < num_tokens <= view.shape[0]:
            return None
        return view[:num_tokens]

    def _ipc_step(self, request: ProposeRequest, accepted: list[int] | None, deadline: float) -> DraftOutput:
        """The cuda_ipc (and nccl_channel) step: one device copy per tensor into the shared slab (the
        current stream; nccl_channel: sent by NCCL), the header, then the drafts on the GPU ([batch, k] int64, a copy of the drafter's output
        queued on the current stream after its wait on the drafts event); the error word is the
        one host read (8 bytes and a stream sync): a set word raises INVALID_ARGUMENT naming its field."""
        t0 = time.perf_counter_ns()
        n, b = fill(self._slab.views, request.inputs)
        t1 = time.perf_counter_ns()
        self.fill_s.append((t1 - t0) / 1e9)
        self.steps["bound"] += 1
        view = self.link.step_async(n, b, request.batch_padded, request.tokens_padded,
                                    max(1e-3, deadline - time.monotonic()), accepted)
        t2 = time.perf_counter_ns()
        drafts = view.clone()  # the view is the next step's output
        t3 = time.perf_counter_ns()
        self.link.raise_for(self.link.error_word())
        self.ipc_marks = (t0, t1, t2, t3, time.perf_counter_ns())
        return DraftOutput(drafts, None, request.batch_padded, request.tokens_padded)

    # ------------------------------------------------------------------ binding
    def _forget(self) -> None:
        """Drop the binding and anything pending (a stale Bind reply is skipped by its call id)."""
        if self.link is not None:
            self.link.close()
        if self._connecting is not None:
            self._connecting[0].close()
        self.link, self._connecting, self._pending, self.bound_to = None, None, None, ""

    def _ask(self, session) -> None:
        """Send a Bind for session on the plane its tensors want, unless one is on its way, it is
        bound so, or the drafter refused it."""
        if self.cfg.mode == "off" or session.session_id == self._refused:
            return
        plane = self._plane()
        pending = self._pending
        if pending is not None and pending.session_id == session.session_id and pending.plane == plane \
                and time.monotonic() - pending.sent_at < BIND_RETRY_S:
            return
        if self._connecting is not None and self._connecting[1] == session.session_id \
                and self._connecting[0].plane == plane:
            return
        if self.link is not None and self.link.alive and self.bound_to == session.session_id \
                and self.link.plane == plane:
            return
        self._forget()
        transport = self.cfg.transport
        if transport == "auto":
            transport = "ipc" if _loopback(self.endpoint) else "tcp"
        self._send_bind(session.session_id, int(session.epoch), transport, session, plane)

    def _plane(self) -> str:
        """The plane for the caller's tensors (cached per device): cuda_ipc where they are on a GPU
        this drafter reads over CUDA IPC (as CudaIpcBoundClient decides), else nccl_channel where
        they are on a GPU and the drafter has not refused it, else the host ring; a plane the config
        names, always."""
        if self.cfg.plane not in (AUTO, wb.CUDA_IPC):
            return self.cfg.plane
        device = self._device
        if device is None:
            return wb.HOST_RING
        plane = self._planes.get(device)
        if plane is None:
            why = cannot_share(self._backend(), device, self._support)
            plane = wb.CUDA_IPC if not why else wb.NCCL_CHANNEL if device.type == "cuda" else wb.HOST_RING
            if why and device.type == "cuda":
                log.info("bound session: not cuda_ipc for tensors on %s (%s); %s", device, why, plane)
            self._planes[device] = plane
        if plane == wb.CUDA_IPC and self._ipc_refused:
            plane = wb.NCCL_CHANNEL if device.type == "cuda" else wb.HOST_RING
        if plane == wb.NCCL_CHANNEL and self._nccl_refused:
            plane = wb.HOST_RING
        return plane

    def _backend(self):
        if self._slabs is None:
            self._slabs = SLABS if SLABS is not None else cuda_slab.TorchSlabs()
        return self._slabs

    def _ask_support(self, until: float):
        """The drafter's CudaIpcSupport by an Info on the control socket, where this process has a
        GPU and the plane may be cuda_ipc (None otherwise, or without an answer by `until`)."""
        if self.cfg.plane not in (AUTO, wb.CUDA_IPC) or not torch.cuda.is_available() \
                or isinstance(self._backend(), cuda_slab.LocalSlabs):
            return None
        if self.control is None:
            self.control = connect_socket(self.ctx, self.endpoint, data=False)
        self._calls += 1
        env = schema.Envelope(call_id=self._calls, method="Info")
        try:
            self.control.send_multipart([wb.encode(env), wb.encode(schema.InfoRequest(cuda_ipc_capable=True))],
                                        flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        while self.control.poll(max(0, int((until - time.monotonic()) * 1000))):
            frames = self.control.recv_multipart()
            got = _ENVELOPE.decode(frames[0])
            if got.call_id == self._calls:
                return None if got.error is not None else _INFO.decode(frames[1]).cuda_ipc
        return None

    def _send_bind(self, session_id: str, epoch: int, transport: str, session, plane: str) -> None:
        buffers = session_buffers(self.spec, session, self.cfg.max_tokens, self._tree_nodes, self._max_message_bytes)
        if buffers is None:
            self._refuse(session_id, "the ring would not fit the drafter's message limit")
            return
        if self.ring is None or self.ring.buffers != buffers:
            self.ring = BoundRing(buffers)
        if self.control is None:
            self.control = connect_socket(self.ctx, self.endpoint, data=False)
        slab = self._share(buffers) if plane == wb.CUDA_IPC else None
        uuid = ""
        if plane == wb.NCCL_CHANNEL:  # the slab on the caller's GPU, sent by NCCL; its GPU named
            self._device_slab(buffers)
            uuid = cuda_ref.device_uuid(self._device) if self._device.type == "cuda" else ""
        self._max_batch = session.max_num_seqs
        self._calls += 1
        body = wb.BindRequest(session_id=session_id, epoch=epoch, plane=plane, transport=transport,
                              buffers=buffers, max_batch=session.max_num_seqs, slab=slab, device_uuid=uuid,
                              doorbell=plane in (wb.CUDA_IPC, wb.NCCL_CHANNEL) and self._doorbell,
                              armed=plane == wb.CUDA_IPC and self._armed,
                              stream=plane == wb.HOST_RING and self._stream,
                              stream_lanes=STREAM_LANES if plane == wb.HOST_RING and self._stream else 0)
        env = schema.Envelope(call_id=self._calls, method=wb.BIND_METHOD)
        try:
            self.control.send_multipart([wb.encode(env), wb.encode(body)], flags=zmq.NOBLOCK)
        except zmq.Again:  # the control socket's queue is full (no drafter): ask again on a later step
            return
        self._pending = _Pending(self._calls, session_id, epoch, transport, time.monotonic(), plane)

    def _share(self, buffers: list[wb.BufferSpec]) -> schema.CudaIpcTensor:
        """The slab on the caller's device (kept while its layout and device stay), shared with
        this device's "inputs ready" event: its reference for the Bind."""
        device, slabs = self._device, self._backend()
        self._device_slab(buffers)
        if device not in self._events:
            self._events[device] = slabs.new_event(device)
        return slabs.share(self._slab.slab, self._events[device][1])

    def _device_slab(self, buffers: list[wb.BufferSpec]) -> None:
        """The ring's layout on the caller's device (kept while its layout and device stay)."""
        if self._slab is None or self._slab.buffers != buffers or self._slab.slab.device != self._device:
            self._slab = BoundRing(buffers, device=self._device)

    def _advance(self, session, until: float) -> None:
        """Take the Bind's reply and connect its data socket, waiting until `until` at most."""
        while self._pending is not None:
            left = until - time.monotonic()
            if not self.control.poll(max(0, int(left * 1000))):
                return
            frames = self.control.recv_multipart()
            env = _ENVELOPE.decode(frames[0])
            pending = self._pending
            if env.call_id != pending.call_id:
                continue
            self._pending = None
            if env.error is not None:
                self._bind_refused(pending, env.error, session)
                continue
            resp = wb.BIND_RESPONSE_DECODER.decode(frames[1])
            try:
                self._connecting = (self._link(resp, pending), pending.session_id)
            except ValueError as exc:  # an ipc data socket in a directory others may write
                self._refuse(pending.session_id, str(exc))
            except DrafterError as exc:  # the drafter's output cannot be opened here: the host ring
                self._no_ipc(pending, session, f"{exc.field}: {exc.message}")
        if self._connecting is not None:
            link, session_id = self._connecting
            try:
                ready = link.connect(until - time.monotonic(), self.cfg.channel_timeout_s)
            except DrafterError as exc:
                self._connecting = None
                link.close()
                log.warning("bound session %s: %s; steps go unbound", session_id, exc.message)
                if link.plane == wb.NCCL_CHANNEL and self.cfg.plane == wb.NCCL_CHANNEL:  # named: that plane or none
                    self._refuse(session_id, exc.message)
                elif link.plane == wb.NCCL_CHANNEL:  # the channel could not be joined: the host ring from now on
                    self._nccl_refused = exc.message
                return
            if ready:
                if isinstance(link, DeviceLink):  # the steps by the doorbell where it can be made (else the data socket)
                    link.open_doorbell(max(until - time.monotonic(), DOORBELL_CONNECT_S))
                self.link, self.bound_to, self._connecting = link, session_id, None
                log.info("session %s bound (%s, %s, ring %d bytes)", session_id, link.plane, link.resp.endpoint,
                         len(self.ring.bytes))

    def _link(self, resp: wb.BindResponse, pending: _Pending):
        """The data path of a binding the drafter accepted (not connected yet)."""
        if pending.plane == wb.NCCL_CHANNEL:
            return ChannelLink(self.ctx, self._slab.slab.device, resp, self._max_batch, len(self.spec.kv_groups),
                               self._slab.slab, self._slab.slots, via=self.endpoint)
        if pending.plane != wb.CUDA_IPC:
            return BoundLink(self.ctx, self.ring, resp, pending.plane, self.endpoint,
                             lanes=STREAM_LANES if resp.stream else 1)
        device = self._slab.slab.device
        return IpcLink(self.ctx, self._backend(), device, resp, self._max_batch, len(self.spec.kv_groups),
                       self._events[device][0], via=self.endpoint, host_wait=same_gpu(self._support, device))

    def _no_ipc(self, pending: _Pending, session, why: str) -> None:
        """The drafter cannot serve this target over CUDA IPC (another container, no --allow-cuda-ipc
        after all): the nccl_channel (tensors on a GPU) or the host ring from now on, asked for at once."""
        self._ipc_refused = why
        log.warning("session %s: cuda_ipc is not possible (%s); binding %s", pending.session_id, why, self._plane())
        self._send_bind(pending.session_id, pending.epoch, pending.transport, session, self._plane())

    def _bind_refused(self, pending: _Pending, error, session) -> None:
        try:
            code = Code(error.code)
        except ValueError:
            code = Code.INTERNAL
        if code == Code.INVALID_ARGUMENT and error.field == "transport" and pending.transport == "ipc" \
                and self.cfg.transport == "auto":  # no ipc socket there: tcp
            self._send_bind(pending.session_id, pending.epoch, "tcp", session, pending.plane)
        elif self._armed and knows_no_armed(DrafterError(code, error.field, error.message)):  # before armed steps
            self._armed = False
            self._send_bind(pending.session_id, pending.epoch, pending.transport, session, pending.plane)
        elif self._doorbell and knows_no_doorbell(
                DrafterError(code, error.field, error.message)):  # a drafter from before the doorbell
            self._doorbell = False
            self._send_bind(pending.session_id, pending.epoch, pending.transport, session, pending.plane)
        elif self._stream and knows_no_stream(DrafterError(code, error.field, error.message)):  # before the stream
            self._stream = False
            self._send_bind(pending.session_id, pending.epoch, pending.transport, session, pending.plane)
        elif pending.plane == wb.CUDA_IPC and error.field in ENVIRONMENT:
            self._no_ipc(pending, session, f"the drafter refused {error.field}: {error.message}")
        elif pending.plane == wb.NCCL_CHANNEL and error.field in CHANNEL_REFUSED:
            why = f"the drafter refused {error.field}: {error.message}"
            if self.cfg.plane == wb.NCCL_CHANNEL:  # named: that plane or none
                self._refuse(pending.session_id, why)
                return
            self._nccl_refused = why
            log.warning("session %s: nccl_channel is not possible (%s); binding the host ring", pending.session_id, why)
            self._send_bind(pending.session_id, pending.epoch, pending.transport, session, wb.HOST_RING)
        elif code not in REBIND:  # a lost session is the unbound call's to report
            self._refuse(pending.session_id, f"{code.name} {error.field}: {error.message}")

    def _refuse(self, session_id: str, why: str) -> None:
        self._refused = session_id
        log.warning("session %s stays unbound (the drafter cannot bind it: %s)", session_id, why)


def session_buffers(spec, session, max_tokens: int, tree_nodes: int, max_message_bytes: int
                    ) -> list[wb.BufferSpec] | None:
    """The ring's buffers for a session (see the module docstring); None when not even one row per
    sequence fits under max_message_bytes."""
    batch = session.max_num_seqs
    tokens = max_tokens or batch * (spec.num_speculative_tokens + 1)
    tokens = max(batch, min(tokens, session.max_num_batched_tokens))
    width = spec.hidden_width
    hidden_dtype = DTYPE_NAMES[DTYPES[spec.dtype]]
    if max_message_bytes:
        fit = (max_message_bytes - _SMALL_BYTES) // (width * DTYPES[spec.dtype].itemsize)
        if fit < batch:
            return None
        tokens = min(tokens, fit)
    specs = [wb.BufferSpec("target_token_ids", "int64", [tokens]),
             wb.BufferSpec("target_positions", "int64", [tokens]),
             wb.BufferSpec(wb.HIDDEN, hidden_dtype, [tokens, width]),
             wb.BufferSpec("next_token_ids", "int64", [batch]),
             wb.BufferSpec("query_start_loc", "int64", [batch + 1]),
             wb.BufferSpec("seq_lens", "int64", [batch]),
             wb.BufferSpec("token_indices_to_sample", "int64", [batch]),
             wb.BufferSpec("num_rejected_tokens", "int64", [batch])]
    for g, group in enumerate(spec.kv_groups):
        columns = -(-(spec.max_model_len + tree_nodes) // group.block_size)
        specs += [wb.BufferSpec(f"block_tables[{g}]", "int64", [batch, columns]),
                  wb.BufferSpec(f"slot_mappings[{g}]", "int64", [tokens])]
    return specs


def fits(ring: BoundRing, request: ProposeRequest, groups: int) -> bool:
    """Whether the request can go bound and mean exactly what it means unbound."""
    inp = request.inputs
    if request.hidden_ipc is not None or request.return_probs or inp.temperatures is not None \
            or getattr(request, "want_predrafts", False):  # pre-drafts are pushed after an unbound reply only
        return False
    v = ring.views
    hidden = inp.target_hidden_states
    if inp.target_token_ids is None or inp.next_token_ids is None or hidden is None:
        return False
    n, b = inp.target_token_ids.shape[0], inp.next_token_ids.shape[0]
    if not (0 < b <= v["next_token_ids"].shape[0] and b <= n <= v["target_token_ids"].shape[0]):
        return False
    if hidden.dtype != v[wb.HIDDEN].dtype or tuple(hidden.shape) != (n, v[wb.HIDDEN].shape[1]):
        return False
    rows = {"target_token_ids": n, "target_positions": n, "next_token_ids": b, "query_start_loc": b + 1,
            "seq_lens": b, "token_indices_to_sample": b, "num_rejected_tokens": b}
    for name, count in rows.items():
        t = getattr(inp, name)
        if t is None and name in _OPTIONAL:
            continue
        if not _int_rows(t, count):
            return False
    tables, slots = inp.block_tables, inp.slot_mappings
    if tables is None or slots is None or len(tables) != groups or len(slots) != groups:
        return False
    for g in range(groups):
        table = tables[g]
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.dtype not in _INT \
                or table.shape[0] != b or table.shape[1] < v[f"block_tables[{g}]"].shape[1]:
            return False
        if not _int_rows(slots[g], n):
            return False
    return True


def _int_rows(t, count: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype in _INT and t.shape[0] == count


def fill(v: dict, inp: ProposeInputs) -> tuple[int, int]:
    """The request's tensors into the views, one copy each (fits() said they fit); the sampled
    rows computed here when the request leaves them to the drafter, as the engine does.  Views on
    the inputs' GPU take the copies asynchronously (fill_through); host views from GPU inputs wait
    for each.  (num_tokens, batch)."""
    n, b = inp.target_token_ids.shape[0], inp.next_token_ids.shape[0]
    v["target_token_ids"][:n].copy_(inp.target_token_ids)
    v["target_positions"][:n].copy_(inp.target_positions)
    v[wb.HIDDEN][:n].copy_(inp.target_hidden_states)
    v["next_token_ids"][:b].copy_(inp.next_token_ids)
    v["query_start_loc"][:b + 1].copy_(inp.query_start_loc)
    v["seq_lens"][:b].copy_(inp.seq_lens)
    for g, (table, slots) in enumerate(zip(inp.block_tables, inp.slot_mappings)):
        dst = v[f"block_tables[{g}]"]
        dst[:b].copy_(table[:, :dst.shape[1]])  # wider: columns max_model_len never reaches
        v[f"slot_mappings[{g}]"][:n].copy_(slots)
    rejected = v["num_rejected_tokens"][:b]
    if inp.num_rejected_tokens is None:
        rejected.zero_()
    else:
        rejected.copy_(inp.num_rejected_tokens)
    sample = v["token_indices_to_sample"][:b]
    if inp.token_indices_to_sample is None:  # the engine's default: each query's last row, less its rejected
        torch.sub(v["query_start_loc"][1:b + 1], 1, out=sample)
        sample.sub_(rejected)
    else:
        sample.copy_(inp.token_indices_to_sample)
    return n, b


def fill_through(mirror: BoundRing, ring: BoundRing, inp: ProposeInputs) -> tuple[int, int]:
    """fill() into the mirror (the ring's layout on the inputs' device: copies queued on its
    stream), then the mirror's used prefix into the host ring in one copy and one stream sync."""
    n, b = fill(mirror.views, inp)
    nbytes = ring.step_bytes(n)
    device = mirror.slab.device
    ring.slab[:nbytes].copy_(mirror.slab[:nbytes], non_blocking=device.type == "cuda")
    if device.type == "cuda":  # the ring is complete once the stream is through the copies
        torch.cuda.current_stream(device).synchronize()
    return n, b


def private(request: ProposeRequest) -> ProposeRequest:
    """The request with host copies of its tensors: a send that gave up may still hold them while
    the caller refills its own buffers for the next step."""

    def own(t):
        return None if t is None else t.detach().to("cpu", copy=True)

    values = {}
    for name in ProposeInputs.__dataclass_fields__:
        value = getattr(request.inputs, name)
        values[name] = [own(t) for t in value] if isinstance(value, list) else own(value)
    return replace(request, inputs=ProposeInputs(**values), accepted_counts=own(request.accepted_counts))


def _device(name: str) -> torch.device:
    """A device name with the current CUDA device's index where it names none."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _loopback(endpoint: str) -> bool:
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
