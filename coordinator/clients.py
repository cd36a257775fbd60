"""The gRPC and ZMQ drafter clients (coordinator.transport) behind the DraftTransport shape.

One ServiceTransport is one connection holding at most one session.  gRPC keeps the per-step
calls on one bidi stream (a timed-out or broken stream is replaced on the next call, so a late
answer can never be taken for a later step's); ZMQ keeps them on one DEALER socket (late replies
are dropped by call id).  The RemoteProposer throws a transport away after a failure and
connects afresh after the breaker's backoff, which sidesteps gRPC's own reconnect backoff
(up to minutes) after a drafter restart.

Auth: `curve` (a ZMQ endpoint's CURVE keys) and `tls` (a gRPC endpoint's TLS / mTLS files) go to
the client made here; each belongs to one scheme, and one given for the other scheme is refused
rather than ignored (a plaintext connection to a drafter that requires auth would fail closed on
every step).  A bound session (coordinator.transport.bound_transport) takes the ZMQ client's
CURVE keys for its own sockets.
"""

from __future__ import annotations

from coordinator.routing import Endpoint
from coordinator.session import PROTOCOL_VERSION, SessionInfo, SessionSpec
from coordinator.transport.grpc_client import GrpcDrafterClient, TlsConfig
from coordinator.transport.zmq_client import CurveConfig, ZmqDrafterClient
from drafter.wire import schema
from drafter.wire.records import DraftOutput, ProposeRequest


def _check_auth_scheme(scheme: str, curve: CurveConfig | None, tls: TlsConfig | None) -> None:
    """Each auth setting belongs to one scheme: refused by name when given for the other."""
    if scheme not in ("grpc", "zmq"):
        raise ValueError(f"ServiceTransport speaks grpc or zmq, not {scheme}")
    if scheme == "zmq" and tls is not None:
        raise ValueError("tls is the grpc transport's setting; a zmq endpoint authenticates with curve")
    if scheme == "grpc" and curve is not None:
        raise ValueError("curve is the zmq transport's setting; a grpc endpoint authenticates with tls")


class ServiceTransport:
    def __init__(self, endpoint: Endpoint, *, timeout_s: float = 1.0, stream: bool = True, share_cuda: bool = False,
                 curve: CurveConfig | None = None, tls: TlsConfig | None = None):
        """share_cuda: CUDA hidden states go as CUDA IPC references to a drafter on this host that
        accepts them (coordinator.transport.cuda_share), e.g.
        RemoteProposer(..., connect=functools.partial(ServiceTransport, share_cuda=True)).
        curve: the CURVE keys for a zmq endpoint; tls: the TLS files for a grpc endpoint (ValueError
        naming the argument when given for the other scheme)."""
        self.name = endpoint.scheme
        self.endpoint = endpoint
        _check_auth_scheme(endpoint.scheme, curve, tls)
        if endpoint.scheme == "grpc":
            self.client = GrpcDrafterClient(endpoint.address, timeout_s=timeout_s, tls=tls, share_cuda=share_cuda)
        else:
            self.client = ZmqDrafterClient(f"tcp://{endpoint.address}", timeout_s=timeout_s, curve=curve,
                                           share_cuda=share_cuda)
        self.use_stream = stream and endpoint.scheme == "grpc"
        self._stream = None

    def attach(self, spec: SessionSpec, timeout: float) -> SessionInfo:
        """Attach, then warm up: the per-step stream is opened and connected here, not on the first step."""
        req = schema.AttachRequest(
            protocol_version=PROTOCOL_VERSION, method=spec.method, num_speculative_tokens=spec.num_speculative_tokens,
            hidden_dtype=spec.dtype, hidden_size=spec.hidden_size, num_aux_layers=spec.num_aux_layers,
            max_model_len=spec.max_model_len, max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            kv_groups=[schema.KVGroup(block_size=g.block_size, num_blocks=g.num_blocks) for g in spec.kv_groups],
            client_name=spec.client, mtp_layer_schedule=spec.mtp_layer_schedule)
        resp = self.client.attach(req, timeout=timeout)
        if self.use_stream and self._stream is None:
            self._stream = self.client.stream()
            self._stream.connect(timeout)
        limits = resp.limits
        return SessionInfo(resp.session_id, str(resp.epoch), tuple(resp.capture_sizes),
                           tuple(resp.token_capture_sizes),
                           limits.max_num_seqs if limits else spec.max_num_seqs,
                           limits.max_num_batched_tokens if limits else spec.max_num_batched_tokens)

    def request_drafts(self, session: SessionInfo, request: ProposeRequest, timeout: float) -> DraftOutput:
        """DraftOutput (draft_token_ids [batch, k], batch_padded, ...) on the given session."""
        state = self.client.session
        if state.session_id != session.session_id:
            # a session belongs to the drafter, not to a socket: a reconnected client carries on
            # with it (and learns from the drafter if it is gone)
            state.session_id, state.epoch = session.session_id, int(session.epoch)
        if self.use_stream:
            if self._stream is None:
                self._stream = self.client.stream()
            return self._stream.request_drafts(request, timeout=timeout)
        return self.client.request_drafts(request, timeout=timeout)

    def detach(self, session: SessionInfo, timeout: float) -> None:
        self.client.detach(timeout=timeout)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self.client.close()
