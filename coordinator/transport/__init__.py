"""Thin drafter clients, one per transport, with the same call shape as DraftEngine.

    client = GrpcDrafterClient("127.0.0.1:50051")        # or ZmqDrafterClient("tcp://127.0.0.1:5555")
    session = client.attach(layout)                     # drafter.wire.schema.AttachRequest (or a dict)
    out = client.request_drafts(request)                # a drafter.wire.records.ProposeRequest -> DraftOutput
    out = client.propose(**engine_kwargs)               # the same from DraftEngine.propose's keywords
    client.detach(); client.close()

share_cuda=True (either client) sends CUDA hidden states as CUDA IPC references to a drafter on the
same host that accepts them, bytes otherwise (cuda_share.py).

Every failure raises drafter.wire.errors.DrafterError(code, field, message) with the server's
code and field; a client-side timeout is DEADLINE_EXCEEDED, an unreachable server UNAVAILABLE
(gRPC) or DEADLINE_EXCEEDED (ZMQ cannot tell a dead server from a slow one).  No retries and no
policy here: fail-closed, re-attach and routing belong to the coordinator built on top.
"""

from coordinator.transport.base import SessionState
from coordinator.transport.grpc_client import GrpcDrafterClient, GrpcProposeStream, TlsConfig
from coordinator.transport.zmq_client import CurveConfig, ZmqDrafterClient

__all__ = ["GrpcDrafterClient", "GrpcProposeStream", "TlsConfig", "ZmqDrafterClient", "CurveConfig",
           "SessionState"]
