"""The ZMQ transport: one ROUTER socket, msgspec headers, tensors as separate zero-copy frames.

    in:   [identity, b"" (optional delimiter, as REQ/DEALER clients send it), Envelope, body, tensors...]
    out:  [identity, b"" (if the request had one), Envelope, body, tensors...]

Envelope and body are msgpack (schema.py); the tensor frames are never copied on the way in
(torch views the received frame) and the drafts leave without a copy.  Nothing is unpickled.
Every message gets exactly one reply, errors included, so a client never waits on a lost one.
With CURVE configured, a client must know the server's public key, and (with a clients
directory) hold an authorised key itself; otherwise the handshake fails and it gets nothing.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import msgspec
import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from drafter.service import probes, schema
from drafter.service.core import ServiceCore
from drafter.service.errors import Code, DrafterError, invalid
from drafter.service.wire import call_from_frames, result_to_frames

log = logging.getLogger("drafter.service.zmq")

MAX_FRAMES = 256
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


class ZmqServer:
    def __init__(self, core: ServiceCore, *, host: str, port: int, max_message_bytes: int,
                 heartbeat_s: float = 30.0, heartbeat_timeout_s: float = 10.0,
                 curve_server_cert: str | None = None, curve_clients_dir: str | None = None,
                 max_inflight: int = 1024):
        self.core = core
        self.host, self.port = host, port
        self.max_message_bytes = max_message_bytes
        self.heartbeat_s, self.heartbeat_timeout_s = heartbeat_s, heartbeat_timeout_s
        self.curve_server_cert, self.curve_clients_dir = curve_server_cert, curve_clients_dir
        self.ctx = zmq.asyncio.Context()
        self.sock = None
        self.auth: AsyncioAuthenticator | None = None
        self._slots = asyncio.Semaphore(max_inflight)
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None

    def start(self) -> int:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)  # per frame; the total is checked below
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.heartbeat_timeout_s * 1000))
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        if self.curve_server_cert:
            public, secret = zmq.auth.load_certificate(self.curve_server_cert)
            if not secret:
                raise ValueError(f"{self.curve_server_cert} holds no secret key (use the .key_secret file)")
            self.auth = AsyncioAuthenticator(self.ctx)
            self.auth.start()
            # Without a clients directory CURVE still encrypts, but any client key is accepted.
            self.auth.configure_curve(domain="*", location=self.curve_clients_dir or zmq.auth.CURVE_ALLOW_ANY)
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_server = True
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        if ":" in self.host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(f"tcp://{host}:{self.port if self.port else '*'}")
        self.port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.sock = sock
        self._loop_task = asyncio.get_running_loop().create_task(self._recv_loop(), name="zmq-recv")
        return self.port

    async def _recv_loop(self) -> None:
        while True:
            await self._slots.acquire()  # backpressure: stop reading while too many calls are open
            try:
                frames = await self.sock.recv_multipart(copy=False)
            except BaseException:
                self._slots.release()
                raise
            probe = probes.start("zmq-tcp")
            task = asyncio.get_running_loop().create_task(self._handle(frames, probe))
            self._tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._slots.release()
        if not task.cancelled() and task.exception() is not None:
            log.error("zmq handler failed", exc_info=task.exception())

    async def _handle(self, frames: list, probe=None) -> None:
        if probe is not None:
            probe.mark("task_start")
        identity = frames[0].bytes
        rest = frames[1:]
        delimited = bool(rest) and len(rest[0]) == 0
        if delimited:
            rest = rest[1:]
        head = [identity, b""] if delimited else [identity]
        env = schema.Envelope()
        try:
            if not rest:
                raise invalid("envelope", "missing envelope frame")
            env = decode_struct(_ENVELOPE, rest[0].buffer, "envelope")
            out, tensors = await self._dispatch(env, rest[1:], probe)
            reply = [_ENCODER.encode(schema.Envelope(call_id=env.call_id, method=env.method)), _ENCODER.encode(out),
                     *tensors]
            if probe is not None:
                probe.mark("reply_encode")
        except Exception as exc:  # noqa: BLE001 - every message gets a reply, even after a bug of ours
            e = exc if isinstance(exc, DrafterError) else DrafterError(Code.INTERNAL, "", repr(exc))
            if not isinstance(exc, DrafterError):
                log.error("zmq handler failed", exc_info=exc, extra={"event": "internal_error", "transport": "zmq"})
            err = schema.Error(code=int(e.code), field=e.field, message=e.message)
            reply = [_ENCODER.encode(schema.Envelope(call_id=env.call_id, method=env.method[:64], error=err)), b""]
        try:
            await self.sock.send_multipart(head + reply, copy=False)
        except zmq.ZMQError as exc:  # the peer went away or the socket closed; nobody to tell
            log.debug("zmq reply dropped: %s", exc)
        if probe is not None and env.method == "Propose":
            probe.mark("send")
            probe.finish()

    async def _dispatch(self, env: schema.Envelope, rest: list, probe=None):
        method = env.method
        async with self.core.serving("zmq", method if method in schema.METHODS else "unknown"):
            if method not in schema.METHODS:
                raise invalid("method", f"unknown method {method!r}; one of {sorted(schema.METHODS)}")
            if len(rest) + 2 > MAX_FRAMES:
                raise invalid("frames", f"{len(rest) + 2} frames; at most {MAX_FRAMES}")
            total = sum(len(f) for f in rest)
            if total > self.max_message_bytes:
                raise invalid("frames", f"{total} bytes exceed max_message_bytes {self.max_message_bytes}")
            if not rest:
                raise invalid("body", "missing body frame")
            body = rest[0].buffer
            req = decode_struct(_DECODERS[method], body, "body") if len(body) else schema.METHODS[method][0]()
            tensors = rest[1:]
            if method == "Propose":
                if probe is not None:
                    probe.mark("header_decode")
                call = call_from_frames(req, tensors)
                call.probe = probe
                if probe is not None:
                    probe.request_id = call.request_id
                    probe.mark("tensor_decode")
                if env.timeout_ms:
                    call.deadline = time.monotonic() + env.timeout_ms / 1000
                result = await self.core.propose(call)
                if probe is not None:
                    probe.mark("handoff_out")
                header, out_frames = result_to_frames(result)
                return header, out_frames
            if tensors:
                raise invalid("frames", f"{method} takes no tensor frames")
            if method == "Attach":
                return await self.core.attach(req), []
            if method == "Detach":
                return await self.core.detach(req), []
            return self.core.info(), []

    async def close(self, timeout: float = 5.0) -> None:
        """Stop reading, let open calls send their replies, then close (lingering to flush them)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, zmq.ZMQError):
                pass
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        if self.sock is not None:
            self.sock.close(linger=int(timeout * 1000))
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
