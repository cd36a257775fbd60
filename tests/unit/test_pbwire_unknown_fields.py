"""A large unknown top-level field of a gRPC ProposeRequest costs no copy and no protobuf parse on the
event loop (issue 19 soak): the fast path leaves unknown fields out of the skeleton it hands to
protobuf, as they change no value of the parsed message, and a request with one decodes to the same
record as without it."""

from __future__ import annotations

import pytest
import torch

from drafter.wire import pbwire
from drafter.wire.errors import DrafterError
from drafter.wire.records import ProposeInputs, ProposeRequest
from drafter.wire.tensors import request_from_proto


def _unknown_len_field(size: int, number: int = 99) -> bytes:
    return pbwire._varint_bytes(number << 3 | 2) + pbwire._varint_bytes(size) + b"\x01" * size


def _valid_raw() -> bytes:
    i64 = torch.int64
    inputs = ProposeInputs(target_token_ids=torch.arange(4, dtype=i64),  # [num_tokens]
                           target_positions=torch.arange(4, dtype=i64),  # [num_tokens]
                           target_hidden_states=torch.ones(4, 8),  # [num_tokens, hidden_size]
                           next_token_ids=torch.tensor([1], dtype=i64),  # [batch]
                           query_start_loc=torch.tensor([0, 4], dtype=i64),  # [batch + 1]
                           seq_lens=torch.tensor([4], dtype=i64),  # [batch]
                           block_tables=[torch.zeros(1, 1, dtype=i64)],  # [batch, max_blocks]
                           slot_mappings=[torch.arange(4, dtype=i64)])  # [num_tokens]
    req = ProposeRequest(inputs=inputs, session_id="s-7", epoch=1, request_id=3)
    return pbwire.encode_propose_request(req).data


def test_an_unknown_field_is_left_out_of_the_skeleton():
    big = 1 << 20
    skeleton, _ = pbwire._split(_unknown_len_field(big))
    assert len(skeleton) < 64, "the unknown field's bytes were copied into the skeleton"


def test_a_request_with_a_large_unknown_field_decodes_as_without_it():
    raw = _valid_raw()
    with_unknown = raw + _unknown_len_field(1 << 20)
    fast, plain, full = (pbwire.request_from_raw(with_unknown), pbwire.request_from_raw(raw),
                         request_from_proto(pbwire.parse_request(with_unknown)))
    for other in (plain, full):
        assert (fast.session_id, fast.epoch, fast.request_id) == (other.session_id, other.epoch, other.request_id)
        for a, b in ((fast.inputs.target_token_ids, other.inputs.target_token_ids),
                     (fast.inputs.target_hidden_states, other.inputs.target_hidden_states),
                     (fast.inputs.slot_mappings[0], other.inputs.slot_mappings[0])):
            assert torch.equal(a, b)


def test_a_large_unknown_field_alone_is_refused_as_protobuf_would():
    raw = _unknown_len_field(1 << 20)
    with pytest.raises(DrafterError) as fast:
        pbwire.request_from_raw(raw)
    with pytest.raises(DrafterError) as full:
        request_from_proto(pbwire.parse_request(raw))
    assert (fast.value.code, fast.value.field) == (full.value.code, full.value.field)
