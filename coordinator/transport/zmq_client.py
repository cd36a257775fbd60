"""ZMQ client for the drafter: a DEALER socket, msgspec headers, tensors as zero-copy frames.

Endpoints: tcp://host:port, or ipc:///path for a drafter on the same host (the path rules of
drafter.wire.ipc are checked before connecting: a socket in a directory others may write
could be replaced by an impostor).

Exceptions: every method raises drafter.wire.errors.DrafterError with the server's code and
field; DEADLINE_EXCEEDED when no reply came within the per-call timeout (ZMQ cannot tell a dead
or unauthorised server from a slow one: with CURVE, a client without the server's key simply
never connects).  Replies to calls that timed out are recognised by call_id and dropped.

Pre-drafts (docs/predraft.md): a Propose sent with want_predrafts may be followed by a pushed
PreDraftPush on this socket; whenever the client reads the socket (a round trip, poll_pushes) it
hands each such push, decoded and checked, to `on_push` (None: dropped).  send_nowait sends a
Propose whose reply nobody waits for: a failure of it is counted in `nowait_failed` when read.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace
from typing import Callable

import msgspec
import zmq
import zmq.auth

from coordinator.transport.base import SessionState, as_attach_request, draft_output, ms, send_request
from coordinator.transport.cuda_share import CudaShare
from drafter.wire import probes, schema
from drafter.wire.errors import Code, DrafterError
from drafter.wire.ipc import check_client_path
from drafter.wire.predraft import PreDrafts, push_from_frames
from drafter.wire.zmqio import NOBLOCK, recv_frames, send_frames
from drafter.wire.records import DraftOutput, ProposeRequest
from drafter.wire.tensors import request_to_frames, tensor_from_frames

_ENCODER = msgspec.msgpack.Encoder()


def _poll(sock: zmq.Socket, event: int, timeout_ms: int) -> bool:
    """Socket.poll without building a Poller per call."""
    return bool(zmq.zmq_poll([(sock, event)], timeout_ms))
_ENVELOPE = msgspec.msgpack.Decoder(schema.Envelope)
_RESPONSES = {m: msgspec.msgpack.Decoder(resp) for m, (_, resp) in schema.METHODS.items()}
_PUSH = msgspec.msgpack.Decoder(schema.PreDraftPush)


@dataclass(frozen=True)
class CurveConfig:
    """server_public: the server's public certificate file (zmq.auth) or its z85 key.
    client_secret: this client's secret certificate file; None = a fresh key pair (enough when
    the server accepts any client key, refused when it keeps an allow list)."""

    server_public: str | bytes
    client_secret: str | None = None

    def keys(self) -> tuple[bytes, bytes, bytes]:
        """(server public, client public, client secret) z85 keys; a fresh client pair without client_secret."""
        server = self.server_public
        if isinstance(server, str):
            server, _ = zmq.auth.load_certificate(server)
        if self.client_secret:
            public, secret = zmq.auth.load_certificate(self.client_secret)
        else:
            public, secret = zmq.curve_keypair()
        return server, public, secret

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = self.keys()

    def apply_to_context(self, ctx: zmq.Context) -> None:
        """Make every socket ctx creates from now on a CURVE client with these keys (one key pair for
        all of them: a bound session's control, data and device sockets)."""
        for opt, key in zip((zmq.CURVE_SERVERKEY, zmq.CURVE_PUBLICKEY, zmq.CURVE_SECRETKEY), self.keys()):
            ctx.setsockopt(opt, key)


class ZmqDrafterClient:
    """One target worker's connection to one drafter. Not thread-safe (neither are ZMQ sockets)."""

    def __init__(self, endpoint: str, *, timeout_s: float = 1.0, curve: CurveConfig | None = None,
                 context: zmq.Context | None = None, share_cuda: bool = False):
        """share_cuda: send CUDA hidden states as CUDA IPC references where the drafter is on this host
        and says it can open them (coordinator.transport.cuda_share); bytes otherwise."""
        if endpoint.startswith("ipc://"):
            check_client_path(endpoint)  # raises IpcPathError (a ValueError) for a path anyone could hijack
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.curve = curve  # kept for a bound session's sockets (coordinator.transport.bound_transport)
        self._probe_label = "client-zmq-ipc" if endpoint.startswith("ipc://") else "client-zmq-tcp"
        self.ctx = context or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Queue only on a finished connection (handshake included): a request never waits in a
        # buffer for a server that is down and then arrives long after its deadline.
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        if curve is not None:
            curve.apply(self.sock)
        self.sock.connect(endpoint)
        self._call_ids = itertools.count(1)
        self._probe = None  # the stage probe of the propose call in flight (drafter.wire.probes)
        self.session = SessionState()
        self.cuda = CudaShare(share_cuda)
        self.on_push: Callable[[PreDrafts], None] | None = None  # pushed pre-drafts go here
        self._nowait: set[int] = set()  # call ids of Propose calls sent with send_nowait, not answered yet
        self.nowait_failed = 0  # of those, answered with an error

    def _roundtrip(self, method: str, body: msgspec.Struct, frames: list, timeout: float | None):
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        call_id = next(self._call_ids)
        env = schema.Envelope(call_id=call_id, method=method, timeout_ms=max(1, int(timeout * 1000)))
        msg = [b"", _ENCODER.encode(env), _ENCODER.encode(body), *frames]
        try:  # a connected socket takes it at once; otherwise wait for the connection within the timeout
            send_frames(self.sock, msg, NOBLOCK)
        except zmq.Again:
            try:
                if not _poll(self.sock, zmq.POLLOUT, int(timeout * 1000)):
                    raise zmq.Again
                send_frames(self.sock, msg, NOBLOCK)
            except zmq.Again:
                raise DrafterError(Code.DEADLINE_EXCEEDED, "",
                                   f"no connection to {self.endpoint} within {ms(timeout)}") from None
        probe = self._probe
        if probe is not None:
            probe.mark("send")
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not _poll(self.sock, zmq.POLLIN, max(1, int(left * 1000))):
                raise DrafterError(Code.DEADLINE_EXCEEDED, "", f"no reply from {self.endpoint} within {ms(timeout)}")
            reply = recv_frames(self.sock, NOBLOCK)
            if probe is not None:
                probe.mark("wait")
            if len(reply) < 3 or len(reply[0]) != 0:
                continue  # not a reply of this protocol
            got = self._unasked(reply)
            if got is None or got.call_id != call_id:
                continue  # a push, the reply of a send_nowait, or the late reply of a call that timed out
            if got.error is not None:
                try:
                    code = Code(got.error.code)
                except ValueError:
                    code = Code.INTERNAL
                raise DrafterError(code, got.error.field, got.error.message)
            try:
                return _RESPONSES[method].decode(reply[2].buffer), reply[3:]
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise DrafterError(Code.INTERNAL, "body", f"undecodable reply: {exc}") from None

    def _unasked(self, reply: list) -> schema.Envelope | None:
        """The envelope of a received message; pushes and send_nowait replies are dealt with here (None)."""
        try:
            got = _ENVELOPE.decode(reply[1].buffer)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None
        if got.method == "PreDrafts":
            self._take_push(reply)
            return None
        if got.call_id in self._nowait:
            self._nowait.discard(got.call_id)
            self.nowait_failed += got.error is not None
            return None
        return got

    def _take_push(self, reply: list) -> None:
        if self.on_push is None or len(reply) < 3:
            return
        try:
            header = _PUSH.decode(reply[2].buffer)
            if header.session_id != self.session.session_id or header.epoch != self.session.epoch:
                return  # another session's (an old one): its KV is not ours
            pre = push_from_frames(header, reply[3:])
        except (msgspec.ValidationError, msgspec.DecodeError, DrafterError):
            return  # a malformed push is no pre-draft; the step drafts exactly
        self.on_push(pre)

    def poll_pushes(self, timeout: float = 0.0, until: Callable[[], bool] | None = None) -> None:
        """Read what has arrived: pushes go to on_push, stale replies are dropped.  With a timeout,
        keep reading as messages come until until() is true or the timeout has passed."""
        deadline = time.monotonic() + timeout
        while True:
            if until is not None and until():
                return
            left = max(0.0, deadline - time.monotonic())
            if not _poll(self.sock, zmq.POLLIN, int(left * 1000)):
                return
            reply = recv_frames(self.sock, NOBLOCK)
            if len(reply) >= 3 and len(reply[0]) == 0:
                self._unasked(reply)

    def send_nowait(self, request: ProposeRequest) -> bool:
        """Send one Propose on this client's session and return at once (its reply is read and
        dropped later); False when the socket would not take it now."""
        self.session.require()
        request = replace(request, session_id=self.session.session_id, epoch=self.session.epoch,
                          request_id=request.request_id or self.session.next_id())
        header, frames = request_to_frames(request)
        call_id = next(self._call_ids)
        env = schema.Envelope(call_id=call_id, method="Propose", timeout_ms=max(1, int(self.timeout_s * 1000)))
        try:
            send_frames(self.sock, [b"", _ENCODER.encode(env), _ENCODER.encode(header), *frames], NOBLOCK)
        except zmq.Again:
            return False
        self._nowait.add(call_id)
        return True

    def attach(self, layout, *, timeout: float | None = None) -> schema.AttachResponse:
        resp, _ = self.cuda.ask(as_attach_request(layout), lambda req: self._roundtrip("Attach", req, [], timeout))
        self.session.set(resp)
        return resp

    def request_drafts(self, request: ProposeRequest, *, timeout: float | None = None) -> DraftOutput:
        """One propose call on this client's session: DraftOutput (draft_token_ids [batch, k])."""
        return send_request(self.session, self.cuda, request, self.timeout_s if timeout is None else timeout,
                            self._send)

    def propose(self, *, timeout: float | None = None, **keywords) -> DraftOutput:
        """The keyword front door: DraftEngine.propose's tensors and ProposeRequest.from_keywords' options."""
        return self.request_drafts(ProposeRequest.from_keywords(**keywords), timeout=timeout)

    def _send(self, request: ProposeRequest, timeout: float) -> DraftOutput:
        probe = probes.start(self._probe_label + ("-cuda" if request.hidden_ipc is not None else ""))
        header, frames = request_to_frames(request)
        if probe is not None:
            probe.request_id = header.request_id
            probe.mark("encode")
        self._probe = probe
        try:
            resp, tensors = self._roundtrip("Propose", header, frames, timeout)
        finally:
            self._probe = None
        drafts = tensor_from_frames("draft_token_ids", resp.draft_token_ids, tensors)
        probs = tensor_from_frames("draft_probs", resp.draft_probs, tensors) if resp.draft_probs else None
        out = draft_output(drafts, probs, resp.batch_padded, resp.tokens_padded)
        if probe is not None:
            probe.mark("decode")
            probe.finish()
        return out

    def detach(self, *, timeout: float | None = None) -> int:
        self.session.require()
        resp, _ = self._roundtrip("Detach", schema.DetachRequest(session_id=self.session.session_id,
                                                                 epoch=self.session.epoch), [], timeout)
        self.session.clear()
        return resp.blocks_released

    def info(self, *, timeout: float | None = None) -> schema.InfoResponse:
        resp, _ = self.cuda.ask(schema.InfoRequest(), lambda req: self._roundtrip("Info", req, [], timeout))
        return resp

    def send_raw(self, frames: list, *, timeout: float | None = None) -> list:
        """Send frames as they are and return the next reply's frames (tests and debugging)."""
        timeout = self.timeout_s if timeout is None else timeout
        if not self.sock.poll(int(timeout * 1000), zmq.POLLOUT):
            raise DrafterError(Code.DEADLINE_EXCEEDED, "", "no connection")
        self.sock.send_multipart(frames, copy=False)
        if not self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise DrafterError(Code.DEADLINE_EXCEEDED, "", "no reply")
        return self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
