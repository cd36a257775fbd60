"""What a target worker and a drafter agree on, and the transport shape the client relies on.

A target worker (one per DP rank; TP rank 0 speaks for its group) *attaches* a session with a
SessionSpec; the drafter allocates that session's KV pools (mirroring the target's block-id
space) and answers with a SessionInfo: its epoch (changes on restart), capture sizes and limits.
Per-step propose calls then carry a drafter.wire.records.ProposeRequest (DraftEngine.propose's tensors).

Any transport with attach / propose / detach / close fits DraftTransport: the in-process one
(coordinator.inprocess) wraps a DraftEngine; the gRPC and ZMQ clients speak to `drafter serve`.
Errors are drafter.wire.errors.DrafterError, with the same codes on every transport (DESIGN 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from drafter.engine.config import KVGroupSpec
from drafter.wire.errors import Code, DrafterError  # noqa: F401 (re-exported for transports)
from drafter.wire.records import DraftOutput, ProposeRequest

PROTOCOL_VERSION = 1

# Error codes by gRPC status name, the same on every transport.  Errors are
# drafter.wire.errors.DrafterError (code: Code, field, message); compare code_name(e) with these.
INVALID_ARGUMENT = Code.INVALID_ARGUMENT.name
NOT_FOUND = Code.NOT_FOUND.name  # unknown session
FAILED_PRECONDITION = Code.FAILED_PRECONDITION.name  # stale epoch: the drafter restarted
RESOURCE_EXHAUSTED = Code.RESOURCE_EXHAUSTED.name
UNAVAILABLE = Code.UNAVAILABLE.name
DEADLINE_EXCEEDED = Code.DEADLINE_EXCEEDED.name

# codes after which the session is gone and the client attaches a new one
SESSION_LOST = (NOT_FOUND, FAILED_PRECONDITION)


def code_name(e: Exception) -> str:
    """An error's code as its gRPC status name ("UNAVAILABLE"), or the exception's type name."""
    code = getattr(e, "code", None)
    if code is None:
        return type(e).__name__
    return getattr(code, "name", str(code))


@dataclass(frozen=True)
class SessionSpec:
    method: str
    num_speculative_tokens: int
    hidden_size: int  # width of one hidden state
    num_aux_layers: int  # 0: the final-normed state; n: n aux states concatenated
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_groups: tuple[KVGroupSpec, ...]  # block size and pool size, mirroring the target's block ids
    dtype: str = "float32"
    client: str = ""  # who attaches (logs): e.g. "target/dp1"
    protocol_version: int = PROTOCOL_VERSION
    # MTP methods: which layer each draft step runs in the target's drafting ("" = not said); the
    # drafter refuses an attach whose schedule is not its own
    mtp_layer_schedule: str = ""

    @property
    def hidden_width(self) -> int:
        return self.hidden_size * max(1, self.num_aux_layers)


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    epoch: str
    capture_sizes: tuple[int, ...]
    token_capture_sizes: tuple[int, ...]
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class DraftResult:
    """One step's drafting outcome as every TP rank sees it (coordinator.tp shares it)."""

    drafts: torch.Tensor | None  # [batch, k] int64, or None = no drafts this step
    generation: int | None  # the drafter session that answered (a change means new, empty KV)


class DraftTransport(Protocol):
    name: str  # "grpc" | "zmq" | "inprocess": labels latency and events

    def attach(self, spec: SessionSpec, timeout: float) -> SessionInfo: ...

    def request_drafts(self, session: SessionInfo, request: ProposeRequest, timeout: float) -> DraftOutput: ...

    def detach(self, session: SessionInfo, timeout: float) -> None: ...

    def close(self) -> None: ...
