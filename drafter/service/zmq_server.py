"""The ZMQ transport: ROUTER sockets (tcp://, optionally ipc://), msgspec headers, tensors as zero-copy frames.

    in:   [identity, b"" (optional delimiter, as REQ/DEALER clients send it), Envelope, body, tensors...]
    out:  [identity, b"" (if the request had one), Envelope, body, tensors...]

Envelope and body are msgpack (schema.py); the tensor frames are never copied on the way in
(torch views the received frame) and the drafts leave without a copy.  Nothing is unpickled.
Every message gets exactly one reply, errors included, so a client never waits on a lost one.
With CURVE configured, a client must know the server's public key, and (with a clients
directory) hold an authorised key itself; otherwise the handshake fails and it gets nothing.
CURVE applies to the ipc:// socket as to the tcp:// one; the ipc path follows drafter.wire.ipc.

The per-step path has no asyncio task and no thread hop it does not need: the sockets are plain
(non-blocking) ZMQ sockets watched by the event loop (add_reader on their FD); a Propose message
is decoded and checked in the reader callback and posted straight to the engine thread, which
encodes and sends the reply itself as soon as the drafts are on the host.  Each socket is used
under its own lock (ZMQ sockets are not thread-safe; a lock serialises the loop's reads and the
engine thread's replies).  The bookkeeping (metrics, in-flight counts) follows in the event loop,
off the reply's path; each such reply holds a ticket of metrics.ReplyLedger until its metrics are
recorded, so a scrape after the reply still counts the call.  Errors are answered from the event
loop.  Every other method is decoded and checked in the reader callback too, and Info (and every
refusal) answered there; only an admitted Attach, Detach or Bind runs as a task, as it awaits the core.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

import msgspec
import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from drafter.wire import probes, schema
from drafter.service.core import ServiceCore
from drafter.wire.errors import Code, DrafterError, invalid
from drafter.wire.ipc import DEFAULT_MODE, bind_ipc, unlink_ipc
from drafter.wire.predraft import push_to_frames
from drafter.wire.records import Caller
from drafter.wire.tensors import request_from_frames, result_to_frames
from drafter.wire.zmqio import NOBLOCK, drop_frames, recv_frames_bounded, send_frames

log = logging.getLogger("drafter.service.zmq")

MAX_FRAMES = 256
ENVELOPE_SLACK = 64 * 1024  # bytes beyond max_message_bytes a message may carry (delimiter, envelope)
READ_BURST = 64  # messages read per wake-up before the loop gets a turn for others
DROP_BURST = 256  # frames of an oversized message released under the socket's lock at a time
# how long one turn of the loop may go on releasing a refused message's frames (answered after the last): the
# socket's other peers wait for the whole drop (ZMQ delivers their messages after it), so it should span few
# turns; the budget bounds how long it holds the loop at once.  0: one slice of DROP_BURST frames per turn
DROP_BUDGET_S = 0.002
_ENVELOPE = msgspec.msgpack.Decoder(schema.Envelope)
_DECODERS = {m: msgspec.msgpack.Decoder(req) for m, (req, _) in schema.METHODS.items()}
_ENCODER = msgspec.msgpack.Encoder()
_PATH = re.compile(r"at `\$\.([A-Za-z_0-9]+(?:\[\d+\])?)")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


def field_of(exc: Exception, default: str) -> str:
    """The top-level field a msgspec error points at ("block_tables[0]"), else `default`."""
    text = str(exc)
    m = _PATH.search(text) or _UNKNOWN.search(text)
    return m.group(1) if m else default


def decode_struct(decoder, buf, what: str):
    try:
        return decoder.decode(buf)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise invalid(field_of(exc, what), f"{what}: {exc}") from None
    except UnicodeDecodeError as exc:  # a str field holding bytes that are not UTF-8 (no path in the error)
        raise invalid(schema.utf8_field(buf, what), f"{what}: a string that is not UTF-8 ({exc.reason})") from None


def peer_identity(frame) -> str:
    """The authenticated client: its CURVE public key (the ZAP User-Id), "" without CURVE."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return ""
    return "curve:" + user if user else ""


def _check_frames(rest: list, max_message_bytes: int) -> None:
    if len(rest) + 2 > MAX_FRAMES:
        raise invalid("frames", f"{len(rest) + 2} frames; at most {MAX_FRAMES}")
    total = sum(len(f) for f in rest)
    if total > max_message_bytes:
        raise invalid("frames", f"{total} bytes exceed max_message_bytes {max_message_bytes}")
    if not rest:
        raise invalid("body", "missing body frame")


class _Endpoint:
    """One bound ROUTER socket and its reader state."""

    __slots__ = ("sock", "label", "endpoint", "fd", "reading", "kicked", "lock", "closed", "dropping", "refused")

    def __init__(self, sock: zmq.Socket, label: str, endpoint: str):
        self.sock, self.label, self.endpoint = sock, label, endpoint
        self.fd = sock.getsockopt(zmq.FD)
        self.reading = False
        self.kicked = False
        self.lock = threading.Lock()  # every use of sock: the event loop reads, the engine thread replies
        self.closed = False
        self.dropping = False  # frames of a refused oversized message are still to be received and released
        self.refused: tuple | None = None  # (frames, over) of that message: answered once its last frame is out

    def send(self, frames: list) -> None:
        """Send one reply (from either thread).  ROUTER never blocks: a peer that is gone or over its
        high-water mark loses the reply, and nobody is left to tell."""
        with self.lock:
            if self.closed:
                return
            try:
                send_frames(self.sock, frames, NOBLOCK)
            except zmq.ZMQError as exc:
                log.debug("zmq reply dropped: %s", exc)


class _ProposeReply:
    """One Propose in flight: its reply leaves from the engine thread, its bookkeeping from the loop."""

    __slots__ = ("server", "ep", "head", "env", "call", "rec", "sent", "ticket")

    def __init__(self, server: "ZmqServer", ep: _Endpoint, head: list, env: schema.Envelope, call, rec):
        self.server, self.ep, self.head, self.env, self.call, self.rec = server, ep, head, env, call, rec
        self.sent = False
        self.ticket: int | None = None  # held from the send until done() has recorded the metrics

    def reply(self, result) -> None:  # engine thread, successful results only
        probe = self.call.probe
        if probe is not None:
            probe.mark("handoff_out")
        header, tensors = result_to_frames(result)
        frames = [*self.head, _ENCODER.encode(schema.Envelope(call_id=self.env.call_id, method=self.env.method)),
                  _ENCODER.encode(header), *tensors]
        if probe is not None:
            probe.mark("reply_encode")
        if self.ticket is None:
            self.ticket = self.server.core.metrics.replies.sent()
        self.ep.send(frames)
        self.sent = True
        if probe is not None:
            probe.mark("send")
            probe.finish()

    def push(self, pre) -> None:  # engine thread, after every reply of the batch: the call's pre-drafts
        header, tensors = push_to_frames(pre, self.call.session_id, self.call.epoch)
        self.ep.send([*self.head, _ENCODER.encode(schema.Envelope(call_id=self.env.call_id, method="PreDrafts")),
                      _ENCODER.encode(header), *tensors])

    def done(self, result) -> None:  # event loop, after reply(): answer what was not sent, then account
        try:
            self._account(result)
        finally:
            if self.ticket is not None:
                self.server.core.metrics.replies.recorded(self.ticket)

    def _account(self, result) -> None:
        server, core = self.server, self.server.core
        try:
            if not self.sent:
                if isinstance(result, BaseException):
                    raise result
                self.reply(result)  # the engine thread could not (a bug of ours): the loop tries once more
        except BaseException as exc:  # noqa: BLE001
            err = core.finish(self.rec, exc)
            server._send_error(self.ep, self.head, self.env, err or exc)
            server._end()
            return
        if not server._closing:
            server._kick(self.ep)  # the engine thread's send may have taken the FD's edge
        core.finish(self.rec)
        server._end()
        try:
            core.record_acceptance(self.call)
        except Exception:  # noqa: BLE001 - metrics only; the answer is out
            log.exception("acceptance metrics failed")


class ZmqServer:
    LOCAL_INFO = True  # Info answered in the reader callback (a front process forwards it instead)

    def __init__(self, core: ServiceCore, *, host: str, port: int, max_message_bytes: int,
                 heartbeat_s: float = 30.0, heartbeat_timeout_s: float = 10.0,
                 curve_server_cert: str | None = None, curve_clients_dir: str | None = None,
                 max_inflight: int = 1024, ipc_path: str | None = None, ipc_mode: int = DEFAULT_MODE,
                 drop_burst: int = DROP_BURST, drop_budget_s: float = DROP_BUDGET_S):
        """drop_burst, drop_budget_s: frames of a refused oversized message released under the socket's
        lock at a time, and for how long one turn of the event loop goes on releasing them."""
        self.core = core
        self.drop_burst, self.drop_budget_s = drop_burst, drop_budget_s
        self.host, self.port = host, port
        self.max_message_bytes = max_message_bytes
        self.heartbeat_s, self.heartbeat_timeout_s = heartbeat_s, heartbeat_timeout_s
        self.curve_server_cert, self.curve_clients_dir = curve_server_cert, curve_clients_dir
        self.ipc_path, self.ipc_mode = ipc_path or None, ipc_mode
        self.ipc_endpoint: str | None = None
        self.max_inflight = max_inflight
        self.ctx = zmq.asyncio.Context()  # owns the context; the authenticator's ZAP handler runs on the loop
        self._plain = zmq.Context.shadow(self.ctx.underlying)  # plain sockets on the same context
        self.sock: zmq.Socket | None = None  # the tcp:// socket
        self.auth: AsyncioAuthenticator | None = None
        self._eps: list[_Endpoint] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight = 0  # messages read and not answered yet (backpressure, close)
        self._paused = False
        self._closing = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ sockets
    def _socket(self, tcp: bool) -> zmq.Socket:
        sock = self._plain.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)  # per frame; the total is checked below
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.heartbeat_timeout_s * 1000))
        if tcp:
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        if self.curve_server_cert:
            public, secret = zmq.auth.load_certificate(self.curve_server_cert)
            if not secret:
                raise ValueError(f"{self.curve_server_cert} holds no secret key (use the .key_secret file)")
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_server = True
        return sock

    def start(self) -> int:
        self._loop = asyncio.get_running_loop()
        if self.curve_server_cert:
            self.auth = AsyncioAuthenticator(self.ctx)
            self.auth.start()
            # Without a clients directory CURVE still encrypts, but any client key is accepted.
            self.auth.configure_curve(domain="*", location=self.curve_clients_dir or zmq.auth.CURVE_ALLOW_ANY)
        sock = self._socket(tcp=True)
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        if ":" in self.host:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(f"tcp://{host}:{self.port if self.port else '*'}")
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.rsplit(":", 1)[1])
        self.sock = sock
        self._eps.append(_Endpoint(sock, "zmq-tcp", endpoint))
        if self.ipc_path:
            ipc = self._socket(tcp=False)
            try:
                self.ipc_endpoint = bind_ipc(ipc, self.ipc_path, self.ipc_mode)
            except Exception:
                ipc.close(linger=0)
                raise
            self._eps.append(_Endpoint(ipc, "zmq-ipc", self.ipc_endpoint))
        for ep in self._eps:
            self._watch(ep)
        return self.port

    def _watch(self, ep: _Endpoint) -> None:
        if not ep.reading:
            self._loop.add_reader(ep.fd, self._readable, ep)
            ep.reading = True
        self._kick(ep)

    def _kick(self, ep: _Endpoint) -> None:
        """Look at the socket again soon.  A ZMQ FD is edge-triggered and a send may consume its
        event: after every send (and on resume) the socket is read until it says EAGAIN."""
        if not ep.kicked:
            ep.kicked = True
            self._loop.call_soon(self._readable, ep)

    def _readable(self, ep: _Endpoint) -> None:
        ep.kicked = False
        if self._closing:
            return
        for _ in range(READ_BURST):
            if self._inflight >= self.max_inflight:  # backpressure: stop reading until calls finish
                self._pause()
                return
            try:
                if ep.dropping:  # the rest of a refused message, for up to drop_budget_s this turn
                    ep.dropping = not self._drain(ep)
                    if ep.dropping:
                        break
                    (frames, over), ep.refused = ep.refused, None
                else:
                    # (held by the engine thread only while it sends a reply: microseconds; waiting for it
                    # here sleeps, where returning would leave the FD signalled and the loop spinning)
                    with ep.lock:
                        if ep.closed:
                            return
                        # capped while receiving: an oversized message is dropped frame by frame, not held
                        frames, over, ep.dropping = recv_frames_bounded(
                            ep.sock, NOBLOCK, MAX_FRAMES + 1, self.max_message_bytes + ENVELOPE_SLACK,
                            self.drop_burst)
                    if ep.dropping:
                        # answered once its last frame is released: a sender that waits for the answer
                        # (as the abuse soak's attackers do) cannot queue its next such message meanwhile
                        ep.refused = (frames, over)
                        continue
            except zmq.Again:
                return
            except zmq.ZMQError as exc:  # closed under us
                log.debug("zmq recv failed: %s", exc)
                return
            self._on_message(ep, frames, over)
        self._kick(ep)  # more may be waiting: continue after the loop's other work

    def _drain(self, ep: _Endpoint) -> bool:
        """Release the refused message's remaining frames, drop_burst at a time with the socket's lock let
        go in between (the engine thread's replies go out), until none is left (True) or this turn has
        spent drop_budget_s (False: the rest on the next turn, after the loop's other work)."""
        until = time.monotonic() + self.drop_budget_s
        while True:
            with ep.lock:
                if ep.closed or drop_frames(ep.sock, NOBLOCK, self.drop_burst):
                    return True
            if time.monotonic() >= until:
                return False

    def _pause(self) -> None:
        self._paused = True
        for ep in self._eps:
            if ep.reading:
                self._loop.remove_reader(ep.fd)
                ep.reading = False

    def _begin(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _end(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()
        if self._paused and not self._closing and self._inflight < self.max_inflight:
            self._paused = False
            for ep in self._eps:
                self._watch(ep)

    def _send(self, ep: _Endpoint, frames: list) -> None:
        ep.send(frames)
        if not self._closing:
            self._kick(ep)

    def _send_error(self, ep: _Endpoint, head: list, env: schema.Envelope, exc: BaseException) -> None:
        e = exc if isinstance(exc, DrafterError) else DrafterError(Code.INTERNAL, "", repr(exc))
        if not isinstance(exc, DrafterError):  # a bug of ours: every message still gets a reply
            log.error("zmq handler failed", exc_info=exc, extra={"event": "internal_error", "transport": "zmq"})
        err = schema.Error(code=int(e.code), field=e.field, message=e.message)
        self._send(ep, head + [_ENCODER.encode(schema.Envelope(call_id=env.call_id, method=env.method[:64],
                                                                error=err)), b""])

    # ------------------------------------------------------------------ messages
    def _on_message(self, ep: _Endpoint, frames: list, over: str = "") -> None:
        probe = probes.start(ep.label)
        identity = frames[0].bytes
        rest = frames[1:]
        delimited = bool(rest) and len(rest[0]) == 0
        if delimited:
            rest = rest[1:]
        head = [identity, b""] if delimited else [identity]
        env = schema.Envelope()
        self._begin()
        try:
            if not rest:
                raise invalid("envelope", "missing envelope frame")
            transport, caller, rest = self._who(ep, identity, rest)
            env = decode_struct(_ENVELOPE, rest[0].buffer, "envelope")
            if over:  # the rest of it was dropped while receiving
                raise invalid("frames", f"message refused and dropped: {over} "
                                        f"(max_message_bytes {self.max_message_bytes}, at most {MAX_FRAMES} frames)")
            if env.method == "Propose":
                self._propose(ep, head, env, rest[1:], probe, caller, transport)
                return
            rec, req = self._admit_unary(env, rest[1:], caller, transport)
            if rec is None:  # answered in this callback (Info)
                self._send(ep, head + [_ENCODER.encode(schema.Envelope(call_id=env.call_id, method=env.method)),
                                       _ENCODER.encode(req)])
                self._end()
                return
        except Exception as exc:  # noqa: BLE001
            self._send_error(ep, head, env, exc)
            self._end()
            return
        task = self._loop.create_task(self._handle(ep, head, env, rec, req, rest[1:], caller))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _who(self, ep: _Endpoint, identity: bytes, rest: list) -> tuple[str, Caller, list]:
        """(transport label, caller, frames from the envelope on) of a received message; rest[0] is its
        first frame after the delimiter.  The connection: the peer's routing id on this socket; the peer:
        its CURVE key, when CURVE is on.  (drafter.service.front's engine side reads both from a frame.)"""
        return "zmq", Caller(peer=peer_identity(rest[0]) if self.curve_server_cert else "",
                             connection=f"{ep.label}:{identity.hex()}"), rest

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._end()
        if not task.cancelled() and task.exception() is not None:
            log.error("zmq handler failed", exc_info=task.exception())

    def _propose(self, ep: _Endpoint, head: list, env: schema.Envelope, rest: list, probe, caller: Caller,
                 transport: str = "zmq") -> None:
        """Decode, check and post one Propose; replies (or raises for the caller to answer) exactly once."""
        rec = self.core.begin(transport, "Propose", caller)
        try:
            _check_frames(rest, self.max_message_bytes)
            body = rest[0].buffer
            req = decode_struct(_DECODERS["Propose"], body, "body") if len(body) else schema.ProposeRequest()
            if probe is not None:
                probe.mark("header_decode")
            call = request_from_frames(req, rest[1:])
            call.caller = caller
            call.probe = probes.labelled(probe, call)
            if probe is not None:
                probe.request_id = call.request_id
                probe.mark("tensor_decode")
            if env.timeout_ms:
                call.deadline = time.monotonic() + env.timeout_ms / 1000
            state = _ProposeReply(self, ep, head, env, call, rec)
            self.core.serve_propose_nowait(call, state.done, state.reply, state.push if call.want_predrafts else None)
        except BaseException as exc:
            raise self.core.finish(rec, exc) or exc from None

    def _admit_unary(self, env: schema.Envelope, rest: list, caller: Caller, transport: str = "zmq"):
        """Any method but Propose, in the reader callback: begin the call and decode and check its body
        here, so a refused message costs no task.  Returns (record, request) for a call that awaits the
        core (Attach, Detach; Bind with request None), or (None, reply) for one answered here (Info).
        Raises the refusal (the call already finished) for the caller to answer."""
        method = env.method
        rec = self.core.begin(transport, method if method in schema.METHODS else "unknown", caller)
        try:
            if method == "Bind":  # bound sessions (drafter.service.bound_sessions) decode their own frames
                return rec, None
            if method not in schema.METHODS:
                raise invalid("method", f"unknown method {method!r}; one of {sorted(schema.METHODS)}")
            _check_frames(rest, self.max_message_bytes)
            body = rest[0].buffer
            req = decode_struct(_DECODERS[method], body, "body") if len(body) else schema.METHODS[method][0]()
            if rest[1:]:
                raise invalid("frames", f"{method} takes no tensor frames")
            if method == "Info" and self.LOCAL_INFO:
                out = self.core.info(req)
                self.core.finish(rec)
                return None, out
            return rec, req
        except BaseException as exc:
            raise self.core.finish(rec, exc) or exc from None

    async def _handle(self, ep: _Endpoint, head: list, env: schema.Envelope, rec, req, rest: list,
                      caller: Caller) -> None:
        try:
            try:
                out = await self._dispatch(env.method, req, rest, caller)
            except BaseException as exc:
                err = self.core.finish(rec, exc)
                if err is None:  # cancelled: no reply
                    raise
                raise err from (None if err is exc else exc)
            self.core.finish(rec)
            reply = [_ENCODER.encode(schema.Envelope(call_id=env.call_id, method=env.method)), _ENCODER.encode(out)]
        except Exception as exc:  # noqa: BLE001 - every message gets a reply, even after a bug of ours
            self._send_error(ep, head, env, exc)
            return
        self._send(ep, head + reply)

    async def _dispatch(self, method: str, req, rest: list, caller: Caller):
        """The awaiting part of an admitted Attach, Detach or Bind (checked by _admit_unary)."""
        if method == "Bind":
            from drafter.service.bound_sessions import BoundPlane
            return await BoundPlane.of(self).bind(rest, caller)
        if method == "Attach":
            return await self.core.attach(req, caller)
        if method == "Info":  # only where LOCAL_INFO is off
            return await self.core.info_of(req, caller)
        return await self.core.detach(req, caller=caller)

    # ------------------------------------------------------------------ shutdown
    async def close(self, timeout: float = 5.0) -> None:
        """Stop reading, let open calls send their replies, then close (lingering to flush them)."""
        if self._loop is not None:
            self._pause()
        self._closing = True
        deadline = time.monotonic() + timeout
        if self._inflight:
            try:
                await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=max(0.01, deadline - time.monotonic()))
        if getattr(self, "_bound_plane", None) is not None:  # bound sessions' data threads
            self._bound_plane.close()
        for ep in self._eps:
            with ep.lock:
                ep.closed = True
                ep.sock.close(linger=int(timeout * 1000))
        if self.ipc_endpoint:
            unlink_ipc(self.ipc_endpoint)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
