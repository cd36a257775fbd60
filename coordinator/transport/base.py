"""What both transport clients share: session state, argument handling, the result type."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import msgspec
import torch

from drafter.engine import DraftOutput
from drafter.wire import schema
from drafter.wire.errors import Code, DrafterError
from drafter.wire.tensors import LIST_FIELDS, TENSOR_FIELDS

# DraftEngine.propose's keyword arguments that travel (everything but return_logits), plus the
# service's own: the acceptance report, agreed padded sizes, a request id and a per-call timeout.
ENGINE_TENSORS = tuple(n for n in TENSOR_FIELDS if n != "accepted_counts") + tuple(LIST_FIELDS)
PROPOSE_OPTIONS = ("return_probs", "batch_padded", "tokens_padded", "accepted_counts", "request_id", "timeout")


def ms(seconds: float) -> str:
    """A duration for error texts: "50 ms", "2.5 ms" (whole milliseconds from 10 ms up)."""
    value = seconds * 1000.0
    return f"{value:.0f} ms" if value >= 10 else f"{value:.1f} ms"


@dataclass
class SessionState:
    session_id: str = ""
    epoch: int = 0
    attach: schema.AttachResponse | None = None
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def require(self) -> None:
        if not self.session_id:
            raise DrafterError(Code.FAILED_PRECONDITION, "session_id", "attach first")

    def set(self, resp: schema.AttachResponse) -> None:
        self.session_id, self.epoch, self.attach = resp.session_id, resp.epoch, resp

    def clear(self) -> None:
        self.session_id, self.epoch, self.attach = "", 0, None

    @property
    def cuda_ipc(self) -> schema.CudaIpcSupport | None:
        """What the drafter said about CUDA IPC when this session attached (None: nothing)."""
        return self.attach.cuda_ipc if self.attach is not None else None

    def next_id(self) -> int:
        return next(self._ids)


def as_attach_request(layout) -> schema.AttachRequest:
    if isinstance(layout, schema.AttachRequest):
        return layout
    if isinstance(layout, dict):
        try:
            return msgspec.convert(layout, schema.AttachRequest)
        except msgspec.ValidationError as exc:
            raise DrafterError(Code.INVALID_ARGUMENT, "layout", str(exc)) from None
    raise TypeError(f"layout must be a drafter.wire.schema.AttachRequest or a dict, not {type(layout).__name__}")


def split_kwargs(kwargs: dict) -> dict:
    """The engine tensors of a propose call; unknown names fail here, not on the server."""
    unknown = set(kwargs) - set(ENGINE_TENSORS)
    if unknown:
        raise TypeError(f"propose() got unexpected keyword arguments {sorted(unknown)}")
    return {k: v for k, v in kwargs.items() if v is not None}


def dispatch_propose(session: SessionState, cuda, timeout_s: float, send, *, return_probs: bool,
                     batch_padded: int | None, tokens_padded: int | None, accepted_counts, request_id: int | None,
                     timeout: float | None, engine_kwargs: dict):
    """What every client's propose does before its transport: the session must be attached, the
    call gets its request id, and the hidden states go by CUDA IPC reference or as bytes (`cuda`,
    a coordinator.transport.cuda_share sharer).  send(request_id, engine tensors, hidden_ipc,
    seconds left, options) puts one request on the wire and returns the DraftOutput."""
    session.require()
    rid = session.next_id() if request_id is None else request_id
    options = dict(return_probs=return_probs, batch_padded=batch_padded, tokens_padded=tokens_padded,
                   accepted_counts=accepted_counts)
    return cuda.propose(split_kwargs(engine_kwargs), session.cuda_ipc,
                        lambda kw, ipc, left: send(rid, kw, ipc, left, options),
                        timeout_s if timeout is None else timeout)


def draft_output(drafts: torch.Tensor, probs: torch.Tensor | None, batch_padded: int,
                 tokens_padded: int) -> DraftOutput:
    # The drafts are a view of the received buffer: a small copy makes them ordinary, writable tensors.
    return DraftOutput(drafts.clone(), probs, batch_padded, tokens_padded)
