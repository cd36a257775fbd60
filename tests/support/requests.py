"""Tests' shorthand for propose records: keyword dicts (as Scenario.call(...).kwargs gives them) ->
drafter.wire.records.ProposeRequest, and the wire encodings of one."""

from __future__ import annotations

from drafter.wire.pbwire import encode_propose_request
from drafter.wire.records import INPUT_FIELDS, ProposeInputs, ProposeRequest
from drafter.wire.tensors import request_to_frames, request_to_proto


def request(kw: dict, session_id: str = "s", epoch: int = 1, request_id: int = 1, *, hidden_ipc=None,
            **options) -> ProposeRequest:
    """options: accepted_counts, return_probs, batch_padded, tokens_padded (ProposeRequest.from_keywords),
    deadline, probe."""
    deadline, probe = options.pop("deadline", None), options.pop("probe", None)
    r = ProposeRequest.from_keywords(**kw, **options)
    r.session_id, r.epoch, r.request_id, r.hidden_ipc = session_id, epoch, request_id, hidden_ipc
    r.deadline, r.probe = deadline, probe
    return r


def present(inp: ProposeInputs) -> dict:
    """The inputs' tensors that are set, by field name (for comparisons with a keyword dict)."""
    return {name: getattr(inp, name) for name in INPUT_FIELDS if getattr(inp, name) is not None}


def to_proto(pb_cls, session_id, epoch, request_id, kw, **options):
    return request_to_proto(pb_cls, request(kw, session_id, epoch, request_id, **options))


def to_frames(session_id, epoch, request_id, kw, **options):
    return request_to_frames(request(kw, session_id, epoch, request_id, **options))


def to_raw(session_id, epoch, request_id, kw, **options):
    return encode_propose_request(request(kw, session_id, epoch, request_id, **options))
