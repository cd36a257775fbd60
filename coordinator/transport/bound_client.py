"""A target's persistent buffers bound to a remote drafter over the host ring (ZMQ) or a gloo channel.

    client = HostRingClient("tcp://127.0.0.1:5555", layout, buffers, max_batch=8)
    bufs = client.views                    # the target's persistent buffers: views into one slab
    ...                                    # every step the target fills their first rows
    drafts = client.step(num_tokens, batch)   # [batch, k] int64

The buffers are described to the drafter once (drafter.wire.bound.BindRequest); both ends lay
them out identically in one contiguous slab (BoundRing), so a step sends a StepHeader and the
slab's used prefix, which the drafter receives straight into its own ring.  No per-tensor work on
either side.  The host ring's steps go on the binding's ring stream (drafter.wire.ring_stream:
STREAM_LANES plain tcp connections, or same-host UNIX ones for transport "ipc", the prefix striped
over as many of them as give each at least lane_bytes (ring_stream.plan), each lane sent by a
thread of its own), else (a drafter that offers none) as the second, zero-copy frame of a ZMQ
message on the data socket.  On a GPU target the slab is pinned and a step may name the GPU buffer
that holds it (step(source=...)): on the stream the header goes first, then its prefix is copied
to the host in a few pieces and each part sent as soon as its piece landed (device_parts), on the
data socket in one copy before the frame.  With plane="gloo_channel" the
prefix goes by a point-to-point send on a two-rank gloo process group instead (drafter.wire.bound).

Two layers: BoundLink is one binding's data path (the data socket, the gloo channel, one step's
send and reply); HostRingClient adds a control socket that attaches and binds, and binds again by
itself.  coordinator.transport.bound_transport puts a BoundLink under the RemoteProposer.

Fails closed as the other clients do: every step has a deadline and raises DrafterError on a
refusal, a timeout or a lost drafter; it never returns drafts it did not receive.  After a
drafter restart (a data socket that no longer connects, a timeout, an unknown session or a stale
epoch) the binding is dropped and the client attaches and binds again by itself; the step that
binds again is refused with FAILED_PRECONDITION (the new binding's KV is empty: resend the
context), the next one drafts.
"""

from __future__ import annotations

import itertools
import time

import msgspec
import torch
import zmq

from coordinator.transport.zmq_client import CurveConfig
from drafter.wire import bound as wb
from drafter.wire import ring_stream as rs
from drafter.wire import schema
from drafter.wire.errors import Code, DrafterError
from drafter.wire.ipc import check_client_path
from drafter.wire.tensors import DTYPES

STREAM_CONNECT_S = 0.5  # at least this long for the ring stream's hello to be answered
STREAM_LANES = 4  # the ring stream's connections per binding: one tcp stream is bound by the core that copies it
D2H_PIECES = 4  # a GPU source's prefix goes to the host ring in at most this many copies (device_parts)
REPLY_SPIN_US = 0  # the ring stream's default reply_spin_us (the r18b run: 3000 took 127-184 us off p50 at batch
# 1 / 16 / 64, one target core busy while it waits; bench/results/2026-11-26-h200x2-host-ring-lanes/)
_ENVELOPE = msgspec.msgpack.Decoder(schema.Envelope)
_ATTACH = msgspec.msgpack.Decoder(schema.AttachResponse)
REBIND = (Code.NOT_FOUND, Code.FAILED_PRECONDITION)  # the drafter forgot the session: attach again


def connect_socket(ctx: zmq.Context, endpoint: str, *, data: bool) -> zmq.Socket:
    """A DEALER to endpoint (an ipc path checked as the ZMQ client checks its own).  data: a
    binding's data socket, which queues only on a live connection (a step to a gone drafter fails
    at once) and never reconnects: a restarted drafter may give the same tcp port to another
    session's binding, which must never get our steps."""
    if endpoint.startswith("ipc://"):
        check_client_path(endpoint)  # IpcPathError (a ValueError): a path others could replace
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if data:
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, -1)
    sock.connect(endpoint)
    return sock


class BoundRing:
    """The slab both ends lay the buffers out in (drafter.wire.bound.ring_layout), pinned where
    CUDA is, and a view per buffer: views[name] is [shape] of its dtype.  device: a mirror of the
    layout in that device's memory instead (a GPU target fills it, then copies its used prefix
    into the host ring at once)."""

    def __init__(self, buffers: list[wb.BufferSpec], device: torch.device | str | None = None):
        self.buffers = list(buffers)
        self.slots, total = wb.ring_layout(self.buffers, lambda d: DTYPES[d].itemsize)
        if device is None:
            self.slab = torch.zeros(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())  # [total]
            self.bytes = memoryview(self.slab.numpy())
        else:
            self.slab = torch.zeros(total, dtype=torch.uint8, device=device)  # [total]
            self.bytes = None
        self.views = {s.name: self.slab[s.offset:s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape)
                      for s in self.slots}

    def step_bytes(self, num_tokens: int) -> int:
        nbytes = wb.step_bytes(self.slots, num_tokens)
        if not 0 <= nbytes <= self.slab.numel():
            raise DrafterError(Code.INVALID_ARGUMENT, "num_tokens", f"{num_tokens} tokens exceed the bound buffers")
        return nbytes


class BoundLink:
    """One binding's data path: its data socket (and gloo channel) and the steps sent on it.
    `alive` turns False for good after anything that leaves the binding in doubt (a send with no
    live connection, a timeout, a lost session, a failed channel): bind again for a new link."""

    def __init__(self, ctx: zmq.Context, ring: BoundRing, resp: wb.BindResponse, plane: str, via: str,
                 lanes: int = 1, d2h_pieces: int = 0, lane_bytes: int = rs.LANE_BYTES,
                 reply_spin_us: int | None = None):
        """via: the control endpoint the Bind went to (a drafter listening on every address
        answers with a wildcard host, which is the control endpoint's host from here); lanes: the
        connections to its ring stream (BindRequest.stream_lanes, where the Bind asked for a stream);
        d2h_pieces: the device-to-host copies a GPU source's prefix goes in on the stream (0: D2H_PIECES);
        lane_bytes: the least bytes per lane a step's prefix is striped with (ring_stream.plan);
        reply_spin_us: on the stream, poll for the reply this long without sleeping before the
        thread blocks for it (a busy core for a wake-up saved; None: REPLY_SPIN_US)."""
        self.ring, self.plane, self.lanes, self.lane_bytes = ring, plane, max(1, lanes), lane_bytes
        self.reply_spin_us = REPLY_SPIN_US if reply_spin_us is None else reply_spin_us
        self.d2h_pieces = d2h_pieces or D2H_PIECES
        host = _host(via)
        self.resp = msgspec.structs.replace(resp, endpoint=reachable(resp.endpoint, host),
                                            store=reachable(resp.store, host) if resp.store else "",
                                            stream=reachable(resp.stream, host) if resp.stream.startswith("tcp://")
                                            else resp.stream)
        self.width = resp.drafts_width
        self.sock = connect_socket(ctx, self.resp.endpoint, data=True)
        self.channel = None  # gloo_channel: the two-rank process group (this side rank 0)
        self.conn = None  # the binding's ring stream (drafter.wire.ring_stream), lane 0, once connect() made it
        self.conns: list = []  # every lane's connection (conns[0] is conn)
        self._pool = None  # lanes > 1: a thread per lane past the first, sending its stripe
        self._reply_buf = bytearray(0)  # the stream's replies land here (rs.read_reply), sized at the first
        self.stream_reason = ""  # why a ring stream the drafter offered is not used
        self.alive = True
        self._steps = itertools.count(1)
        self._events: list = []  # CUDA events of the chunks' device-to-host copies, reused
        # the last step's perf_counter_ns on both sides (one host clock): "begin" (step() called),
        # "sent" (the header's send began: on the data socket after a GPU source's copy to the
        # host, on the stream before it), "pushed" (the prefix handed to the kernel), the drafter's wb.STAMPS and
        # wb.RING_STAMPS, "answered" (the reply read), "read" (the drafts in a tensor)
        self.stamps: dict[str, int] = {}

    def connect(self, timeout_s: float, channel_timeout_s: float) -> bool:
        """Wait (at most timeout_s) until the data socket is connected, then join the gloo channel
        (channel_timeout_s bounds the join and each later send) or connect the ring stream the
        drafter offered; False if the data socket did not connect in time."""
        deadline = time.monotonic() + timeout_s
        if not self.sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLOUT):  # connected (IMMEDIATE)
            return False
        if self.plane == wb.GLOO_CHANNEL and self.channel is None:
            self.channel = join_channel(self.resp, channel_timeout_s)
        if self.resp.stream and self.conn is None:
            self._open_stream(max(deadline - time.monotonic(), STREAM_CONNECT_S))
        return True

    def _open_stream(self, timeout_s: float) -> None:
        """The ring stream (its hello answered within timeout_s); where it cannot be made the steps
        keep the data socket (stream_reason says why)."""
        try:
            for lane in range(self.lanes):
                self.conns.append(rs.connect(self.resp.stream, self.resp.bind_id, timeout_s, lane))
        except (OSError, ValueError) as exc:
            self.stream_reason = f"the ring stream {self.resp.stream[:64]} cannot be used: {exc}"
            self._close_stream()
            return
        self.conn = self.conns[0]
        if self.lanes > 1:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.lanes - 1, thread_name_prefix="ring-lane")

    def _close_stream(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns, self.conn = [], None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def close(self) -> None:
        self.alive = False
        self.channel = None
        self._close_stream()
        if not self.sock.closed:
            self.sock.close(linger=0)

    def step(self, num_tokens: int, batch: int, batch_padded: int, tokens_padded: int,
             timeout_s: float, accepted_counts: list[int] | None = None,
             source: torch.Tensor | None = None) -> torch.Tensor:
        """Draft for the ring's first num_tokens / batch rows: [batch, width] int64 (a new tensor:
        the ring may be refilled at once).  accepted_counts: [batch] (-1: no report) for the
        drafter's acceptance metrics.  source: [ring bytes] uint8, the ring's layout on a GPU that
        holds the step (its used prefix goes to the ring by device-to-host copies first: on the
        ring stream in chunks, each sent once it landed).  DrafterError: UNAVAILABLE 'data' when
        the binding has no live connection (the drafter did not run the step), the drafter's
        refusal, or DEADLINE_EXCEEDED."""
        self.stamps = {"begin": time.perf_counter_ns()}
        nbytes = self.ring.step_bytes(num_tokens)
        step = next(self._steps)
        head = wb.StepHeader(step=step, num_tokens=num_tokens, batch=batch, batch_padded=batch_padded,
                             tokens_padded=tokens_padded, nbytes=nbytes, bind_id=self.resp.bind_id,
                             accepted_counts=accepted_counts or [])
        if self.conn is not None:
            return self._stream_step(head, source, timeout_s)
        if source is not None:  # the whole prefix to the host first: one frame
            self.ring.slab[:nbytes].copy_(source[:nbytes], non_blocking=source.device.type == "cuda")
            if source.device.type == "cuda":
                torch.cuda.current_stream(source.device).synchronize()
        self.stamps["sent"] = time.perf_counter_ns()
        try:
            self._send(head)
        except zmq.Again:  # no live connection: the drafter (or this binding) went away
            self.close()
            raise DrafterError(Code.UNAVAILABLE, "data", f"no live connection to {self.resp.endpoint}") from None
        self.stamps["pushed"] = time.perf_counter_ns()
        return self._reply(step, batch, timeout_s)

    # ------------------------------------------------------------------ the ring stream
    def _stream_step(self, head: wb.StepHeader, source: torch.Tensor | None, timeout_s: float) -> torch.Tensor:
        """The header on the ring stream first (the drafter reads it while the prefix is copied to
        the host), then each lane's stripe (parts of a GPU source sent as each piece lands), then
        the reply within timeout_s."""
        deadline = time.monotonic() + timeout_s
        spans = rs.plan(head.nbytes, len(self.conns), self.lane_bytes)
        self.stamps["sent"] = time.perf_counter_ns()
        try:
            for conn in self.conns[:len(spans)]:
                conn.settimeout(max(timeout_s, 1e-3))
            rs.send_head(self.conn, wb.encode(head), head.nbytes, spans, head.step)
            rs.send_stripes(self.conns, spans, head.step, self._parts(head.nbytes, source), self._pool)
        except TimeoutError:
            self.close()
            raise DrafterError(Code.DEADLINE_EXCEEDED, "", f"bound step {head.step}: the prefix was not taken "
                                                           f"in {timeout_s:.3f} s") from None
        except OSError as exc:  # the drafter (or this binding) went away: it cannot run a step it did not get
            self.close()
            raise DrafterError(Code.UNAVAILABLE, "data", f"the ring stream is closed: {exc}") from None
        self.stamps["pushed"] = time.perf_counter_ns()
        return self._stream_reply(head, deadline, timeout_s)

    def _parts(self, nbytes: int, source: torch.Tensor | None):
        """part(start, end) for rs.send_striped: the host ring's bytes of [start, end) once they are
        there.  A GPU source's prefix is copied to the host ring chunk by chunk (every copy queued
        here, an event after each): a part waits for its chunk's event alone."""
        ring = self.ring
        if source is None or source.device.type != "cuda":
            if source is not None:
                ring.slab[:nbytes].copy_(source[:nbytes])
            return lambda a, z: ring.bytes[a:z]
        while len(self._events) < self.d2h_pieces:
            self._events.append(torch.cuda.Event())
        return device_parts(source, ring.slab, ring.bytes, nbytes, self._events, self.d2h_pieces)

    def _stream_reply(self, head: wb.StepHeader, deadline: float, timeout_s: float) -> torch.Tensor:
        """The step's StepDone and drafts from the stream; a silent drafter is DEADLINE_EXCEEDED, a
        closed or garbled stream UNAVAILABLE; either closes the link."""
        conn, size = self.conn, head.batch * self.width * 8
        if len(self._reply_buf) < rs.PREFIX.size + rs.MAX_HEAD + size:
            self._reply_buf = bytearray(rs.PREFIX.size + rs.MAX_HEAD + size)
        try:
            if self.reply_spin_us:
                rs.spin_readable(conn, min(self.reply_spin_us / 1e6, deadline - time.monotonic()))
            rs.deadline_timeout(conn, deadline)
            frame, body = rs.read_reply(conn, self._reply_buf, size)
        except TimeoutError:
            self.close()
            raise DrafterError(Code.DEADLINE_EXCEEDED, "", f"bound step {head.step}: no reply in "
                                                           f"{timeout_s:.3f} s") from None
        except (OSError, ValueError) as exc:  # Closed, a FrameError: the drafter's side is gone or garbled
            self.close()
            raise DrafterError(Code.UNAVAILABLE, "", f"bound step {head.step}: the ring stream failed: {exc}") from None
        self.stamps["answered"] = time.perf_counter_ns()
        done = wb.DONE_DECODER.decode(frame)
        if done.code == Code.UNAVAILABLE:  # the drafter closed the stream after it (a lane lost)
            self.close()
        raise_if_refused(done, self.close)
        if done.step != head.step or len(body) != size:
            self.close()
            raise DrafterError(Code.UNAVAILABLE, "", f"bound step {head.step}: the ring stream answered step "
                                                     f"{done.step} with {len(body)} bytes")
        self._stamp(done)
        drafts = torch.frombuffer(bytearray(body), dtype=torch.int64).view(head.batch, self.width)
        self.stamps["read"] = time.perf_counter_ns()
        return drafts

    def _stamp(self, done: wb.StepDone) -> None:
        """The drafter's stamps into self.stamps (zeros: points its path does not pass)."""
        for name, ns in zip(wb.STAMPS + wb.RING_STAMPS, done.stamps):
            if ns:
                self.stamps[name] = ns

    def _send(self, head: wb.StepHeader) -> None:
        """The header, and the ring's prefix as its second frame or down the gloo channel."""
        if self.channel is None:
            self.sock.send_multipart([wb.encode(head), self.ring.bytes[:head.nbytes]], flags=zmq.NOBLOCK, copy=False)
            return
        self.sock.send(wb.encode(head), flags=zmq.NOBLOCK)
        try:
            self.channel.send([self.ring.slab[:head.nbytes]], 1, 0).wait()
        except RuntimeError as exc:  # the peer went away or timed out: the channel is gone
            self.close()
            raise DrafterError(Code.UNAVAILABLE, "", f"the gloo channel failed: {exc}") from None

    def _reply(self, step: int, batch: int, timeout_s: float) -> torch.Tensor:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                self.close()  # the frame may still sit in a queue: the ring is no longer lent to it
                raise DrafterError(Code.DEADLINE_EXCEEDED, "", f"bound step {step}: no reply in {timeout_s:.3f} s")
            frames = self.sock.recv_multipart(copy=False)
            done = wb.DONE_DECODER.decode(frames[0].buffer)
            if done.step != step:
                continue  # an answer to a step that already timed out
            self.stamps["answered"] = time.perf_counter_ns()
            raise_if_refused(done, self.close)
            self._stamp(done)
            drafts = torch.frombuffer(bytearray(frames[1].buffer), dtype=torch.int64)
            self.stamps["read"] = time.perf_counter_ns()
            return drafts.view(batch, self.width)


class HostRingClient:
    """A target's own bound session: attach, bind and step on one drafter, binding again by itself."""

    def __init__(self, endpoint: str, layout: schema.AttachRequest, buffers: list[wb.BufferSpec], *,
                 max_batch: int, transport: str = "tcp", plane: str = wb.HOST_RING, timeout_s: float = 5.0,
                 stream: bool = True, lanes: int = STREAM_LANES, staging: str = "span", d2h_pieces: int = 0,
                 lane_bytes: int = rs.LANE_BYTES, reply_spin_us: int | None = None, curve: CurveConfig | None = None):
        """stream: host_ring steps on the binding's ring stream (drafter.wire.ring_stream) where the
        drafter offers one and it can be reached, else (and with False) on the ZMQ data socket;
        lanes: the stream's connections, each prefix striped over them (1 to ring_stream.MAX_LANES);
        staging: the GPU drafter's host-to-device copy, "span" (as each span lands) or "step" (one
        copy at the step; BindRequest.stream_staging); d2h_pieces: the device-to-host copies of a
        GPU source's prefix (0: D2H_PIECES; 1: one copy, the body sent once it is whole); lane_bytes:
        a step's prefix goes on as many lanes as give each at least this many bytes (ring_stream.plan:
        a small prefix on lane 0 alone; 0: every lane once it holds ring_stream.CHUNK per lane);
        reply_spin_us: BoundLink's; curve: the drafter's CURVE keys (coordinator.transport.zmq_client),
        used by the control socket and every binding's data socket alike."""
        if not 1 <= lanes <= rs.MAX_LANES:
            raise ValueError(f"lanes must lie in [1, {rs.MAX_LANES}], got {lanes}")
        self.endpoint, self.layout, self.plane = endpoint, layout, plane
        self.max_batch, self.transport, self.timeout_s = max_batch, transport, timeout_s
        self.stream, self.lanes = stream and plane == wb.HOST_RING, lanes
        self.staging, self.d2h_pieces, self.lane_bytes = staging, d2h_pieces, lane_bytes
        self.reply_spin_us = reply_spin_us
        self.ring = BoundRing(buffers)
        self.views = self.ring.views
        self.ctx = zmq.Context()
        if curve is not None:
            curve.apply_to_context(self.ctx)
        self.control = connect_socket(self.ctx, endpoint, data=False)
        self.link: BoundLink | None = None
        self.session: schema.AttachResponse | None = None
        self.binds = 0  # how many times this client bound (a restart shows as one more)
        self._calls = itertools.count(1)

    @property
    def channel(self):  # gloo_channel: the bound link's process group
        return self.link.channel if self.link is not None else None

    @property
    def data(self) -> zmq.Socket | None:  # the bound link's data socket, while it lives
        return self.link.sock if self.link is not None and self.link.alive else None

    @property
    def stamps(self) -> dict[str, int]:  # the last step's perf_counter_ns on both sides (BoundLink.stamps)
        return self.link.stamps if self.link is not None else {}

    # ------------------------------------------------------------------ control
    def _call(self, method: str, body, decoder, deadline: float):
        return control_call(self.control, next(self._calls), method, body, decoder, deadline, self.timeout_s)

    def bind(self) -> wb.BindResponse:
        """Attach, register the buffers and connect the session's data socket."""
        self.unbind()
        deadline = time.monotonic() + self.timeout_s
        self.session = self._call("Attach", self.layout, _ATTACH, deadline)
        req = wb.BindRequest(session_id=self.session.session_id, epoch=self.session.epoch, transport=self.transport,
                             plane=self.plane, buffers=self.ring.buffers, max_batch=self.max_batch,
                             stream=self.stream, stream_lanes=self.lanes if self.stream and self.lanes > 1 else 0,
                             stream_staging=self.staging if self.stream else "span")
        try:
            resp = self._call(wb.BIND_METHOD, req, wb.BIND_RESPONSE_DECODER, deadline)
        except DrafterError as err:
            if not (req.stream and knows_no_stream(err)):
                raise
            self.stream = False  # a drafter from before the ring stream, or one that refuses it: the data socket
            resp = self._call(wb.BIND_METHOD, msgspec.structs.replace(req, stream=False, stream_lanes=0,
                                                                      stream_staging="span"),
                              wb.BIND_RESPONSE_DECODER, deadline)
        link = BoundLink(self.ctx, self.ring, resp, self.plane, self.endpoint, lanes=self.lanes,
                         d2h_pieces=self.d2h_pieces, lane_bytes=self.lane_bytes, reply_spin_us=self.reply_spin_us)
        if not link.connect(deadline - time.monotonic(), self.timeout_s):
            link.close()
            raise DrafterError(Code.DEADLINE_EXCEEDED, "", f"the data socket {resp.endpoint} did not connect")
        self.link = link
        self.binds += 1
        return resp

    def detach(self) -> None:
        """End the session on the drafter (its blocks go back to the pool) and forget the binding."""
        if self.session is not None:
            body = schema.DetachRequest(session_id=self.session.session_id, epoch=self.session.epoch)
            self._call("Detach", body, msgspec.msgpack.Decoder(schema.DetachResponse),
                       time.monotonic() + self.timeout_s)
        self.unbind()

    def unbind(self) -> None:
        """Forget the binding (the drafter's side ends with its session)."""
        if self.link is not None:
            self.link.close()
        self.link, self.session = None, None

    def close(self) -> None:
        """Close the sockets and the context (call it: a context left to the garbage collector
        can block in term() inside whatever code the collector interrupts)."""
        if self.control.closed:
            return
        self.unbind()
        self.control.close(linger=0)
        self.ctx.term()

    # ------------------------------------------------------------------ steps
    def step(self, num_tokens: int, batch: int, batch_padded: int = 0, tokens_padded: int = 0,
             accepted_counts: list[int] | None = None, source: torch.Tensor | None = None) -> torch.Tensor:
        """Draft for the rows the target wrote into the views' first num_tokens / batch rows (or
        into source, [ring bytes] uint8: the ring's layout on a GPU, BoundLink.step);
        [batch, width] int64 (a new tensor: the slab may be refilled at once)."""
        if self.data is None:
            self._bind_in_step()
        try:
            return self.link.step(num_tokens, batch, batch_padded, tokens_padded, self.timeout_s, accepted_counts,
                                  source)
        except DrafterError as exc:
            if exc.code == Code.UNAVAILABLE and exc.field == "data":  # nothing sent: the drafter went away
                self.unbind()
                self._bind_in_step()
            raise

    def _bind_in_step(self) -> None:
        """Bind; after the first binding, a new one means the drafter's KV for this target is
        empty (a restart, a forgotten session): the step is refused (FAILED_PRECONDITION), as
        RemoteProposer returns no drafts for a step during which its session changed, so the
        target resends the context before it drafts again under the new binding."""
        first = self.binds == 0
        self.bind()
        if not first:
            raise DrafterError(Code.FAILED_PRECONDITION, "session",
                               "bound again (the drafter restarted or forgot the session): resend the context")


_WILDCARDS = ("0.0.0.0", "::", "*", "")


def _host(endpoint: str) -> str:
    """The host of tcp://host:port (ipc endpoints: "")."""
    if not endpoint.startswith("tcp://"):
        return ""
    return endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")


def reachable(address: str, host: str) -> str:
    """A tcp endpoint (or a store's host:port) with a wildcard host replaced by `host`."""
    scheme, sep, rest = address.rpartition("://")
    if scheme and scheme != "tcp":
        return address
    where, _, port = rest.rpartition(":")
    if where.strip("[]") not in _WILDCARDS or not host:
        return address
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}{sep}{host}:{port}"


def join_channel(resp: wb.BindResponse, timeout_s: float):
    """This side (rank 0) of the binding's two-rank gloo group, on the drafter's TCPStore."""
    import datetime

    import torch.distributed as dist

    host, port = resp.store.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host.strip("[]"), int(port), 2, False, timeout=timeout)
        return dist.ProcessGroupGloo(dist.PrefixStore(resp.channel, store), 0, 2, timeout)
    except RuntimeError as exc:
        raise DrafterError(Code.UNAVAILABLE, "store", f"joining the gloo channel at {resp.store}: {exc}") from None


def device_parts(source: torch.Tensor, slab: torch.Tensor, view: memoryview, nbytes: int, events: list,
                 pieces: int = D2H_PIECES):
    """A GPU source's prefix to the pinned host slab in at most `pieces` copies of whole stripe
    units, all queued now on the current stream with an event after each; part(start, end) (a
    span of rs.send_striped's) waits for the event of the piece holding its last byte (the copies
    complete in order) and gives view[start:end].

    source: [>= nbytes] uint8 on a GPU; slab: [>= nbytes] uint8 pinned, view its bytes; events:
    at least `pieces` CUDA events.  Fewer, larger copies than chunks: each copy queued costs
    microseconds of host time before the first chunk can go."""
    from coordinator.transport.bound_ipc import current_stream  # the Stream kept per stream (a lookup costs ~10 us)

    per_piece = -(-nbytes // pieces)
    piece = max(1, -(-per_piece // rs.CHUNK)) * rs.CHUNK  # whole units per copy
    stream = current_stream(source.device)
    for i, a in enumerate(range(0, nbytes, piece)):
        z = min(nbytes, a + piece)
        slab[a:z].copy_(source[a:z], non_blocking=True)
        events[i].record(stream)

    def part(a: int, z: int):
        events[(z - 1) // piece].synchronize()
        return view[a:z]
    return part


def knows_no_stream(err: DrafterError) -> bool:
    """Whether a Bind refusal says bind again without BindRequest.stream: a drafter that does not
    know the field (its decoder refuses it), or one that refuses the ring stream (FAILED_PRECONDITION
    "stream": over tcp it is not authenticated and the drafter requires auth)."""
    return (err.code == Code.INVALID_ARGUMENT and err.field == "body" and "stream" in err.message) or (
        err.code == Code.FAILED_PRECONDITION and err.field == "stream")


def raise_if_refused(done: wb.StepDone, close) -> None:
    """A refused step as the DrafterError it names; the link is closed first where the binding is
    gone (REBIND codes: the next step binds again)."""
    if done.code:
        code = Code(done.code)
        if code in REBIND:
            close()
        raise DrafterError(code, done.field, done.message)


def control_call(control: zmq.Socket, call_id: int, method: str, body, decoder, deadline: float, timeout_s: float):
    """One control request and its reply on a DEALER (stale replies of earlier calls are skipped)."""
    control.send_multipart([wb.encode(schema.Envelope(call_id=call_id, method=method)), wb.encode(body)])
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not control.poll(int(left * 1000) + 1):
            raise DrafterError(Code.DEADLINE_EXCEEDED, "", f"{method}: no reply in {timeout_s} s")
        frames = control.recv_multipart()
        env = _ENVELOPE.decode(frames[0])
        if env.call_id != call_id:
            continue
        if env.error is not None:
            raise DrafterError(Code(env.error.code), env.error.field, env.error.message)
        return decoder.decode(frames[1])
