"""The client's side of CUDA IPC without a GPU: when a reference replaces the bytes, and the fall back
to bytes when the drafter cannot use references from here."""

from __future__ import annotations

import pytest
import torch

from coordinator.transport.cuda_share import CudaShare
from drafter.wire import schema
from drafter.wire.cuda_ref import FIELD
from drafter.wire.errors import Code, DrafterError
from tests.support.cuda_refs import UUID, ref
from tests.support.requests import present, request

SUPPORT = schema.CudaIpcSupport(enabled=True, host_id="boot-1", device_uuids=[UUID])


def _share(enabled=True) -> CudaShare:
    return CudaShare(enabled, host_id=lambda: "boot-1", device_uuid=lambda device: UUID)


def _request():
    return request({"target_hidden_states": torch.randn(4, 8), "target_token_ids": torch.arange(4)})


class Recorder:
    """A transport's one call: records what was sent, raises the queued errors first."""

    def __init__(self, *errors):
        self.errors = list(errors)
        self.sent: list = []

    def __call__(self, request, timeout):
        self.sent.append((set(present(request.inputs)), request.hidden_ipc, timeout))
        if self.errors:
            raise self.errors.pop(0)
        return "drafts"


def _forced(share: CudaShare) -> CudaShare:
    """Sharing as if the hidden states were on a GPU of this host (no GPU here)."""
    share.usable = lambda t, support: share.enabled
    share.reference = lambda t: ref(*t.shape)
    return share


def test_cpu_tensors_and_missing_support_send_bytes():
    share = _share()
    for support in (SUPPORT, None, schema.CudaIpcSupport(enabled=False, reason="cpu")):
        assert not share.usable(torch.randn(4, 8), support)
    send = Recorder()
    assert share.send(_request(), SUPPORT, send, 1.0) == "drafts"
    assert send.sent == [({"target_hidden_states", "target_token_ids"}, None, 1.0)]
    assert not _share(enabled=False).usable(torch.randn(4, 8), SUPPORT)


def test_a_shared_step_sends_the_reference_instead_of_the_bytes():
    send = Recorder()
    _forced(_share()).send(_request(), SUPPORT, send, 1.0)
    (names, hidden_ipc, _), = send.sent
    assert names == {"target_token_ids"} and hidden_ipc == ref(4, 8)


@pytest.mark.parametrize("field", ["handle", "device_uuid", "step_event_handle"])
def test_a_reference_this_host_cannot_share_falls_back_to_bytes_for_good(field):
    share = _forced(_share())
    send = Recorder(DrafterError(Code.INVALID_ARGUMENT, f"{FIELD}.{field}", "cannot open"))
    assert share.send(_request(), SUPPORT, send, 1.0) == "drafts"
    assert [s[1] is None for s in send.sent] == [False, True], "the same step again, with bytes"
    assert "target_hidden_states" in send.sent[1][0] and 0 < send.sent[1][2] <= 1.0
    assert not share.enabled and field in share.reason
    share.send(_request(), SUPPORT, send, 1.0)
    assert send.sent[2][1] is None, "and bytes from then on"


@pytest.mark.parametrize("err", [
    DrafterError(Code.INVALID_ARGUMENT, FIELD, "must be finite"),  # the request's content: bytes would not help
    DrafterError(Code.INVALID_ARGUMENT, f"{FIELD}.shape", "shape [3, 8], expected [4, 8]"),
    DrafterError(Code.DEADLINE_EXCEEDED, "", "no reply"),
    DrafterError(Code.NOT_FOUND, "session_id", "unknown session"),
], ids=lambda e: f"{e.code.name}-{e.field}")
def test_other_refusals_are_the_callers_and_sharing_stays_on(err):
    share = _forced(_share())
    with pytest.raises(DrafterError) as got:
        share.send(_request(), SUPPORT, Recorder(err), 1.0)
    assert got.value is err and share.enabled


def test_a_tensor_torch_cannot_share_goes_as_bytes():
    share = _forced(_share())

    def cannot(t):
        raise RuntimeError("Attempted to send CUDA tensor received from another process")
    share.reference = cannot
    send = Recorder()
    share.send(_request(), SUPPORT, send, 1.0)
    assert send.sent[0][1] is None and not share.enabled


def test_the_client_asks_for_support_only_while_sharing_and_copes_with_older_drafters():
    sent = []

    def drafter(req):  # an older drafter over ZMQ: an unknown field is refused by name
        sent.append(req.cuda_ipc_capable)
        if req.cuda_ipc_capable:
            raise DrafterError(Code.INVALID_ARGUMENT, "cuda_ipc_capable", "unknown field `cuda_ipc_capable`")
        return "answer"
    assert _share(enabled=False).ask(schema.InfoRequest(), drafter) == "answer" and sent == [False]
    share = _share()
    assert share.ask(schema.AttachRequest(method="eagle3"), drafter) == "answer"
    assert sent[1:] == [True, False] and not share.enabled and "predates" in share.reason
    def draining(req):
        raise DrafterError(Code.UNAVAILABLE, "", "draining")
    share = _share()
    with pytest.raises(DrafterError):
        share.ask(schema.InfoRequest(), draining)
    assert share.enabled, "only the flag's refusal says the drafter predates CUDA IPC"
