"""gRPC client for the drafter: unary calls on a blocking channel, and a bidi stream per step.

Exceptions: every method raises drafter.wire.errors.DrafterError.  Its code is the server's
status (with the offending field from the "drafter-field" trailer), DEADLINE_EXCEEDED when the
per-call timeout passed, UNAVAILABLE when the server cannot be reached or is draining.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import grpc

from coordinator.transport.base import SessionState, as_attach_request, draft_output, ms, send_request
from coordinator.transport.cuda_share import CudaShare
from drafter._proto.drafter.v1 import drafter_pb2 as pb
from drafter.wire import probes, schema
from drafter.wire.errors import FIELD_METADATA_KEY, Code, DrafterError
from drafter.wire.pbwire import encode_propose_request
from drafter.wire.records import DraftOutput, ProposeRequest
from drafter.wire.tensors import struct_from_proto, struct_to_proto, tensor_from_proto

SERVICE = "/drafter.v1.Drafter/"
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class TlsConfig:
    """PEM files. root_ca verifies the server; cert + key are this client's identity (mTLS)."""

    root_ca: str
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None  # when the certificate names another host than the address

    def credentials(self) -> grpc.ChannelCredentials:
        read = lambda p: open(p, "rb").read() if p else None  # noqa: E731
        return grpc.ssl_channel_credentials(read(self.root_ca), read(self.key), read(self.cert))


def _channel_options(max_message_bytes: int, tls: TlsConfig | None) -> list:
    opts = [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
            # gRPC shares subchannels (and their reconnect backoff, which grows to minutes) between
            # all channels of a process: a client that reconnects after a drafter restart would
            # keep failing fast until that timer fires.  A channel of its own connects at once.
            ("grpc.use_local_subchannel_pool", 1)]
    if tls is not None and tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return opts


def error_from_rpc(exc: grpc.RpcError) -> DrafterError:
    code = Code.from_grpc(exc.code()) if hasattr(exc, "code") else Code.UNAVAILABLE
    field = ""
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == FIELD_METADATA_KEY:
            field = value
    return DrafterError(code, field, exc.details() if hasattr(exc, "details") else str(exc))


def _error_from_message(err) -> DrafterError:
    try:
        code = Code(err.code)
    except ValueError:
        code = Code.INTERNAL
    return DrafterError(code, err.field, err.message)


def _output(resp):
    drafts = tensor_from_proto("draft_token_ids", resp.draft_token_ids)
    probs = tensor_from_proto("draft_probs", resp.draft_probs) if resp.HasField("draft_probs") else None
    return draft_output(drafts, probs, resp.batch_padded, resp.tokens_padded)


class GrpcDrafterClient:
    """One target worker's connection to one drafter. Not for concurrent use from several threads."""

    def __init__(self, target: str, *, timeout_s: float = 1.0, tls: TlsConfig | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, share_cuda: bool = False):
        """share_cuda: send CUDA hidden states as CUDA IPC references where the drafter is on this host
        and says it can open them (coordinator.transport.cuda_share); bytes otherwise."""
        self.target = target
        self.timeout_s = timeout_s
        self.tls = tls
        self.max_message_bytes = max_message_bytes
        opts = _channel_options(max_message_bytes, tls)
        self.channel = (grpc.secure_channel(target, tls.credentials(), options=opts) if tls
                        else grpc.insecure_channel(target, options=opts))
        ser = lambda m: m.SerializeToString()  # noqa: E731
        self._attach = self.channel.unary_unary(SERVICE + "Attach", ser, pb.AttachResponse.FromString)
        self._propose = self.channel.unary_unary(SERVICE + "Propose", ser, pb.ProposeResponse.FromString)
        self._detach = self.channel.unary_unary(SERVICE + "Detach", ser, pb.DetachResponse.FromString)
        self._info = self.channel.unary_unary(SERVICE + "Info", ser, pb.InfoResponse.FromString)
        self.session = SessionState()
        self.cuda = CudaShare(share_cuda)

    def _call(self, method, request, timeout):
        try:
            return method(request, timeout=self.timeout_s if timeout is None else timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    def attach(self, layout, *, timeout: float | None = None) -> schema.AttachResponse:
        resp = struct_from_proto(self.cuda.ask(as_attach_request(layout), lambda req: self._call(
            self._attach, struct_to_proto(req, pb.AttachRequest()), timeout)), schema.AttachResponse)
        self.session.set(resp)
        return resp

    def request_drafts(self, request: ProposeRequest, *, timeout: float | None = None) -> DraftOutput:
        """One unary propose call on this client's session: DraftOutput (draft_token_ids [batch, k])."""
        return send_request(self.session, self.cuda, request, self.timeout_s if timeout is None else timeout,
                            self._send_unary)

    def propose(self, *, timeout: float | None = None, **keywords) -> DraftOutput:
        """The keyword front door: DraftEngine.propose's tensors and ProposeRequest.from_keywords' options."""
        return self.request_drafts(ProposeRequest.from_keywords(**keywords), timeout=timeout)

    def _send_unary(self, request: ProposeRequest, timeout: float) -> DraftOutput:
        probe = probes.start("client-grpc-unary" + ("-cuda" if request.hidden_ipc is not None else ""))
        req = encode_propose_request(request)
        if probe is not None:
            probe.request_id = req.request_id
            probe.mark("encode")
        resp = self._call(self._propose, req, timeout)
        if probe is not None:
            probe.mark("wait")
        out = _output(resp)
        if probe is not None:
            probe.mark("decode")
            probe.finish()
        return out

    def detach(self, *, timeout: float | None = None) -> int:
        self.session.require()
        req = pb.DetachRequest(session_id=self.session.session_id, epoch=self.session.epoch)
        resp = self._call(self._detach, req, timeout)
        self.session.clear()
        return resp.blocks_released

    def info(self, *, timeout: float | None = None) -> schema.InfoResponse:
        resp = self.cuda.ask(schema.InfoRequest(), lambda req: self._call(
            self._info, struct_to_proto(req, pb.InfoRequest()), timeout))
        return struct_from_proto(resp, schema.InfoResponse)

    def stream(self) -> "GrpcProposeStream":
        """A bidi stream for the per-step path, on this client's session."""
        return GrpcProposeStream(self)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


async def _settle_tasks(turns: int = 3, timeout_s: float = 1.0) -> None:
    """Finish every other task of this (private) loop before it stops.

    grpc.aio keeps a task per call that waits for the call's status
    (_AioCall._handle_status_once_received); after a cancel or a channel close it needs a few more
    loop turns.  Stopping the loop first left it pending, and Python reported "Task was destroyed but
    it is pending!" when the loop was collected (seen after gRPC load-test runs and broken streams).
    A few turns let such tasks end on their own; what is left then is cancelled and awaited.
    """
    me = asyncio.current_task()
    for _ in range(turns):
        if all(t is me or t.done() for t in asyncio.all_tasks()):
            return
        await asyncio.sleep(0)
    rest = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for t in rest:
        t.cancel()
    if rest:
        await asyncio.wait(rest, timeout=timeout_s)


class GrpcProposeStream:
    """ProposeStream with a blocking, per-call-timeout API (grpc.aio on a private event-loop thread).

    Each propose() writes one request and waits for its response.  After a timeout or a broken
    stream the next call opens a new stream, so a late answer can never be taken for a later step's.
    While draining the server ends the stream: that propose raises UNAVAILABLE.
    """

    def __init__(self, client: GrpcDrafterClient):
        self.client = client
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-stream", daemon=True)
        self._thread.start()
        self._channel = None
        self._call = None
        self._run(self._open_channel())

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _open_channel(self):
        c = self.client
        opts = _channel_options(c.max_message_bytes, c.tls)
        self._channel = (grpc.aio.secure_channel(c.target, c.tls.credentials(), options=opts) if c.tls
                         else grpc.aio.insecure_channel(c.target, options=opts))
        self._method = self._channel.stream_stream(SERVICE + "ProposeStream", lambda m: m.SerializeToString(),
                                                   pb.ProposeResponse.FromString)

    def connect(self, timeout: float) -> bool:
        """Connect the channel and open the stream's call now (a client does it at attach), so the first
        step pays no TCP, TLS or HTTP/2 set-up and keeps within its deadline like the rest.  False when
        the channel is not ready within `timeout`: the first step then connects, as it would have."""
        try:
            self._run(self._connect(), timeout)
            return True
        except Exception:  # noqa: BLE001 - best effort: the step's own errors are the ones that count
            return False

    async def _connect(self):
        await self._channel.channel_ready()
        if self._call is None:
            self._call = self._method()

    async def _step(self, req):
        if self._call is None:
            self._call = self._method()
        await self._call.write(req)
        resp = await self._call.read()
        if resp is grpc.aio.EOF:
            raise DrafterError(Code.UNAVAILABLE, "", "the server ended the stream")
        return resp

    async def _reset(self):
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def _step_with_timeout(self, req, timeout: float):
        try:
            return await asyncio.wait_for(self._step(req), timeout)
        except asyncio.TimeoutError:
            await self._reset()
            raise DrafterError(Code.DEADLINE_EXCEEDED, "", f"no answer within {ms(timeout)}") from None
        except (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError, DrafterError) as exc:
            err = await self._ended(exc)  # the stream is over: its status says why
            await self._reset()
            raise err from None

    async def _ended(self, exc: Exception) -> DrafterError:
        call = self._call
        if call is not None and call.done():
            try:
                status, details, trailers = await call.code(), await call.details(), await call.trailing_metadata()
            except Exception:  # noqa: BLE001
                status = None
            if status is not None and status != grpc.StatusCode.OK:
                return DrafterError(Code.from_grpc(status), dict(trailers or ()).get(FIELD_METADATA_KEY, ""), details)
        if isinstance(exc, DrafterError):
            return exc
        if isinstance(exc, grpc.RpcError):
            return error_from_rpc(exc)
        return DrafterError(Code.UNAVAILABLE, "", f"the stream ended: {exc}")

    def request_drafts(self, request: ProposeRequest, *, timeout: float | None = None) -> DraftOutput:
        """One propose call on the stream: DraftOutput (draft_token_ids [batch, k])."""
        c = self.client
        return send_request(c.session, c.cuda, request, c.timeout_s if timeout is None else timeout, self._send)

    def propose(self, *, timeout: float | None = None, **keywords) -> DraftOutput:
        """The keyword front door: DraftEngine.propose's tensors and ProposeRequest.from_keywords' options."""
        return self.request_drafts(ProposeRequest.from_keywords(**keywords), timeout=timeout)

    def _send(self, request: ProposeRequest, timeout: float) -> DraftOutput:
        probe = probes.start("client-grpc-stream" + ("-cuda" if request.hidden_ipc is not None else ""))
        req = encode_propose_request(request)
        if probe is not None:
            probe.request_id = request.request_id
            probe.mark("encode")
        resp = self._run(self._step_with_timeout(req, timeout))
        if probe is not None:
            probe.mark("wait")
        if resp.HasField("error"):
            raise _error_from_message(resp.error)
        out = _output(resp)
        if probe is not None:
            probe.mark("decode")
            probe.finish()
        return out

    def close(self) -> None:
        if self._loop.is_closed():
            return

        async def shutdown():
            if self._call is not None:
                try:
                    await self._call.done_writing()
                except Exception:  # noqa: BLE001 - the stream may already be over
                    pass
                self._call.cancel()
            await self._channel.close()
            await _settle_tasks()
        try:
            self._run(shutdown(), timeout=5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
