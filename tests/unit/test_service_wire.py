"""Tensor codec: strict checks before torch sees any byte; exact round trips on both encodings."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from drafter._proto.drafter.v1 import drafter_pb2 as pb
from drafter.wire import schema
from drafter.wire.errors import Code, DrafterError
from drafter.wire.tensors import (
    DTYPES, FLOAT, INT, decode_tensor, request_from_frames, request_from_proto, struct_from_proto, struct_to_proto,
    tensor_bytes)
from tests.support.requests import present, to_frames, to_proto


def _kwargs():
    g = torch.Generator().manual_seed(0)
    return dict(
        target_token_ids=torch.tensor([5, 6, 7], dtype=torch.int32),  # [num_tokens]
        target_positions=torch.tensor([0, 1, 2]),  # [num_tokens]
        target_hidden_states=torch.randn(3, 8, generator=g).to(torch.bfloat16),  # [num_tokens, hidden]
        next_token_ids=torch.tensor([9], dtype=torch.int32),  # [batch]
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),  # [batch + 1]
        seq_lens=torch.tensor([3], dtype=torch.int32),  # [batch]
        block_tables=[torch.tensor([[4, 1]], dtype=torch.int32), torch.tensor([[2]], dtype=torch.int64)],
        slot_mappings=[torch.tensor([64, 65, 66]), torch.tensor([-1, 33, 34])],
        temperatures=torch.tensor([0.5]),
    )


def _same(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, list):
            assert len(x) == len(y) and all(u.dtype == v.dtype and torch.equal(u, v) for u, v in zip(x, y))
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), k


def test_proto_round_trip_keeps_dtypes_and_values():
    kw = _kwargs()
    req = pb.ProposeRequest.FromString(to_proto(pb.ProposeRequest, "s", 7, 3, kw, return_probs=True,
                                                     batch_padded=4, accepted_counts=torch.tensor([2]))
                                       .SerializeToString())
    call = request_from_proto(req)
    assert (call.session_id, call.epoch, call.request_id, call.return_probs, call.batch_padded) == ("s", 7, 3, True, 4)
    assert torch.equal(call.accepted_counts, torch.tensor([2]))
    _same(present(call.inputs), kw)


def test_frames_round_trip_is_zero_copy_on_decode():
    kw = _kwargs()
    header, frames = to_frames("s", 7, 3, kw)
    frames = [bytes(f) for f in frames]
    header = schema.ProposeRequest(**{f: getattr(header, f) for f in header.__struct_fields__})
    call = request_from_frames(header, frames)
    _same(present(call.inputs), kw)
    hidden = call.inputs.target_hidden_states
    source = frames[header.target_hidden_states.frame]
    assert hidden.untyped_storage().data_ptr() == torch.frombuffer(source, dtype=torch.uint8).data_ptr()


@pytest.mark.parametrize("dtype,shape,nbytes,kind,ndim,why", [
    ("float64", [2], 16, FLOAT, 1, "not allowed"),
    ("int8", [2], 2, INT, 1, "not allowed"),
    ("float32", [2], 8, INT, 1, "not an integer"),
    ("int32", [2], 8, FLOAT, 1, "not an float"),
    ("int32", [2, 1], 8, INT, 1, "dimensions"),
    ("int32", [], 4, INT, 1, "dimensions"),
    ("int32", [-1], 4, INT, 1, "sizes"),
    ("int32", [2**40], 4, INT, 1, "sizes"),
    ("int32", [3], 8, INT, 1, "needs 12 bytes"),
    ("float16", [2, 3], 11, FLOAT, 2, "needs 12 bytes"),
])
def test_decode_refuses_before_touching_the_bytes(dtype, shape, nbytes, kind, ndim, why):
    with pytest.raises(DrafterError) as e:
        decode_tensor("target_hidden_states", dtype, shape, b"\0" * nbytes, ndim, kind)
    assert e.value.code == Code.INVALID_ARGUMENT and e.value.field == "target_hidden_states"
    assert why in e.value.message


def test_unaligned_buffers_are_copied_not_misread():
    t = torch.arange(5, dtype=torch.int64)
    raw = b"x" + bytes(tensor_bytes(t))
    out = decode_tensor("seq_lens", "int64", [5], memoryview(raw)[1:], 1, INT)
    assert torch.equal(out, t)


# too_slow times the draws by the wall clock: a starved box is not a slow strategy
@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(sorted(DTYPES)), shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
       extra=st.integers(-3, 3))
def test_decode_accepts_exactly_the_right_byte_count(dtype, shape, extra):
    td = DTYPES[dtype]
    n = math.prod(shape) * td.itemsize + extra
    kind = FLOAT if td.is_floating_point else INT
    if extra == 0:
        out = decode_tensor("x", dtype, shape, bytes(max(n, 0)), len(shape), kind)
        assert list(out.shape) == shape and out.dtype == td
    elif n >= 0:
        with pytest.raises(DrafterError, match="bytes"):
            decode_tensor("x", dtype, shape, bytes(n), len(shape), kind)


def test_missing_and_misnamed_fields_are_named():
    kw = _kwargs()
    del kw["seq_lens"]
    with pytest.raises(DrafterError) as e:
        request_from_proto(to_proto(pb.ProposeRequest, "s", 1, 1, kw))
    assert e.value.field == "seq_lens" and "missing" in e.value.message
    kw = _kwargs()
    header, frames = to_frames("s", 1, 1, kw)
    header.block_tables[1].frame = 99
    with pytest.raises(DrafterError) as e:
        request_from_frames(header, frames)
    assert e.value.field == "block_tables[1]"
    kw = _kwargs()
    kw["block_tables"] = []
    with pytest.raises(DrafterError) as e:
        request_from_proto(to_proto(pb.ProposeRequest, "s", 1, 1, kw))
    assert e.value.field == "block_tables"


def test_struct_proto_conversion_round_trips():
    msg = schema.AttachResponse(
        session_id="abc", epoch=2**64 - 1, capture_sizes=[1, 2, 4], limits=schema.Limits(
            max_model_len=96, max_message_bytes=2**40, kv_groups=[schema.KVGroup(block_size=16, num_blocks=3)]),
        speculative_token_tree=[schema.TreePath(ranks=[0]), schema.TreePath(ranks=[0, 1])], protocol_version=1)
    back = struct_from_proto(pb.AttachResponse.FromString(struct_to_proto(msg, pb.AttachResponse())
                                                           .SerializeToString()), schema.AttachResponse)
    assert back == msg
