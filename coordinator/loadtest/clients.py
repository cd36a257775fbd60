"""The transport clients of coordinator.transport, each also telling the size of its last messages.

The clients are used unchanged (same wire code, same errors); each subclass only hooks the one
place where the encoded request and the reply are both at hand, to record their sizes:

  zmq         ZmqDrafterClient._roundtrip: envelope + body + tensor frames, both directions
  grpc        GrpcProposeStream._step_with_timeout (the bidi stream, the per-step path): ByteSize()
  grpc-unary  GrpcDrafterClient._call (the unary Propose): ByteSize() of request and response

Sizes are the serialized message bytes (payload), without transport framing (HTTP/2, ZMTP).
"""

from __future__ import annotations

import msgspec

from coordinator.client_auth import ClientAuth
from coordinator.transport.grpc_client import GrpcDrafterClient, GrpcProposeStream
from coordinator.transport.zmq_client import ZmqDrafterClient
from drafter.wire import schema

TRANSPORTS = ("zmq", "grpc", "grpc-unary")
_ENCODER = msgspec.msgpack.Encoder()


class MeasuredZmqClient(ZmqDrafterClient):
    last_sizes = (0, 0)

    def _roundtrip(self, method, body, frames, timeout):
        env = schema.Envelope(call_id=1, method=method, timeout_ms=1)  # the same few bytes as the real one
        sent = len(_ENCODER.encode(env)) + len(_ENCODER.encode(body)) + sum(memoryview(f).nbytes for f in frames)
        self.last_sizes = (sent, 0)
        resp, tensors = super()._roundtrip(method, body, frames, timeout)
        got = len(_ENCODER.encode(schema.Envelope(call_id=1))) + len(_ENCODER.encode(resp)) + sum(
            len(f) for f in tensors)
        self.last_sizes = (sent, got)
        return resp, tensors


class MeasuredGrpcClient(GrpcDrafterClient):
    last_sizes = (0, 0)

    def _call(self, method, request, timeout):
        self.last_sizes = (request.ByteSize(), 0)
        resp = super()._call(method, request, timeout)
        self.last_sizes = (self.last_sizes[0], resp.ByteSize())
        return resp


class MeasuredGrpcStream(GrpcProposeStream):
    last_sizes = (0, 0)

    async def _step_with_timeout(self, req, timeout):
        self.last_sizes = (req.ByteSize(), 0)
        resp = await super()._step_with_timeout(req, timeout)
        self.last_sizes = (self.last_sizes[0], resp.ByteSize())
        return resp


class Connection:
    """One sender's connection to the drafter: attach/info/detach on `client`, propose on `caller`
    (the client itself, or its bidi stream for "grpc")."""

    def __init__(self, transport: str, endpoint: str, timeout_s: float, auth: ClientAuth = ClientAuth()):
        """auth: the run's client auth (--curve-* for zmq, --tls-* for grpc)."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.transport = transport
        if transport == "zmq":
            self.client = MeasuredZmqClient(zmq_endpoint(endpoint), timeout_s=timeout_s, **auth.for_scheme("zmq"))
            self.caller = self.client
        else:
            self.client = MeasuredGrpcClient(grpc_target(endpoint), timeout_s=timeout_s, **auth.for_scheme("grpc"))
            self.caller = MeasuredGrpcStream(self.client) if transport == "grpc" else self.client

    def share_session(self, resp: schema.AttachResponse) -> None:
        """Send on a session another connection attached (a session is a name, not a connection)."""
        self.client.session.set(resp)

    def propose(self, timeout: float, kwargs: dict):
        return self.caller.propose(timeout=timeout, **kwargs)

    @property
    def last_sizes(self) -> tuple[int, int]:
        return self.caller.last_sizes

    def close(self) -> None:
        if self.caller is not self.client:
            self.caller.close()
        self.client.close()


def zmq_endpoint(endpoint: str) -> str:
    return endpoint if "://" in endpoint else f"tcp://{endpoint}"


def grpc_target(endpoint: str) -> str:
    return endpoint.split("://", 1)[1] if endpoint.startswith("tcp://") else endpoint
