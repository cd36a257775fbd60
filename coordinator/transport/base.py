"""What both transport clients share: session state, argument handling, the result type."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import msgspec
import torch

from drafter.wire import schema
from drafter.wire.errors import Code, DrafterError
from drafter.wire.records import DraftOutput, ProposeRequest


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


def send_request(session: SessionState, cuda, request: ProposeRequest, timeout: float, send) -> DraftOutput:
    """What every client does before its transport: the session must be attached, the request gets
    the session, its epoch and a request id (unless it brings one), and its hidden states go by CUDA
    IPC reference or as bytes (`cuda`, a coordinator.transport.cuda_share sharer).
    send(request, seconds left) puts one request on the wire and returns the DraftOutput."""
    session.require()
    request = replace(request, session_id=session.session_id, epoch=session.epoch,
                      request_id=request.request_id or session.next_id())
    return cuda.send(request, session.cuda_ipc, send, timeout)


def draft_output(drafts: torch.Tensor, probs: torch.Tensor | None, batch_padded: int,
                 tokens_padded: int) -> DraftOutput:
    # The drafts are a view of the received buffer: a small copy makes them ordinary, writable tensors.
    return DraftOutput(drafts.clone(), probs, batch_padded, tokens_padded)
