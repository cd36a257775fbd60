"""CUDA IPC references on the wire: both transports carry them alike, and every malformed field is
refused by name before anything could open it."""

from __future__ import annotations

import msgspec
import pytest
import torch

from drafter._proto.drafter.v1 import drafter_pb2 as pb
from drafter.wire import schema
from drafter.wire.cuda_ref import FIELD, decode_ref
from drafter.wire.errors import Code, DrafterError
from drafter.wire.pbwire import request_from_raw
from drafter.wire.tensors import request_from_frames, request_from_proto
from tests.support.requests import to_frames, to_proto, to_raw
from tests.support.cuda_refs import ref, ref_message

ROWS, WIDTH = 6, 24


def _kwargs(with_hidden: bool = True) -> dict:
    kw = {"target_token_ids": torch.arange(ROWS), "target_positions": torch.arange(ROWS),
          "next_token_ids": torch.tensor([1, 2]), "query_start_loc": torch.tensor([0, 2, ROWS]),
          "seq_lens": torch.tensor([2, 4]), "block_tables": [torch.zeros(2, 3, dtype=torch.int32)],
          "slot_mappings": [torch.arange(ROWS)]}
    if with_hidden:
        kw["target_hidden_states"] = torch.randn(ROWS, WIDTH)
    return kw


def _via_zmq(kwargs, hidden_ipc):
    header, frames = to_frames("s", 7, 3, kwargs, hidden_ipc=hidden_ipc)
    header = msgspec.msgpack.decode(msgspec.msgpack.encode(header), type=schema.ProposeRequest)
    return request_from_frames(header, [bytes(f) for f in frames])


def _via_grpc_fast(kwargs, hidden_ipc):
    return request_from_raw(to_raw("s", 7, 3, kwargs, hidden_ipc=hidden_ipc).data)


def _via_grpc_proto(kwargs, hidden_ipc):
    raw = to_proto(pb.ProposeRequest, "s", 7, 3, kwargs, hidden_ipc=hidden_ipc).SerializeToString()
    return request_from_proto(pb.ProposeRequest.FromString(raw))


PATHS = [_via_zmq, _via_grpc_fast, _via_grpc_proto]


@pytest.mark.parametrize("path", PATHS, ids=lambda f: f.__name__)
def test_a_reference_travels_unchanged_on_every_path(path):
    r = ref(ROWS, WIDTH, torch.bfloat16, row_stride=WIDTH + 8, storage_offset=5, seed=3)
    call = path(_kwargs(with_hidden=False), r)
    assert call.hidden_ipc == r
    assert call.inputs.target_hidden_states is None
    assert torch.equal(call.inputs.target_token_ids, torch.arange(ROWS))
    plain = path(_kwargs(), None)  # and without one, nothing changes
    assert plain.hidden_ipc is None and plain.inputs.target_hidden_states.shape == (ROWS, WIDTH)


@pytest.mark.parametrize("path", PATHS, ids=lambda f: f.__name__)
def test_exactly_one_of_bytes_and_reference(path):
    with pytest.raises(DrafterError) as both:
        path(_kwargs(), ref(ROWS, WIDTH))
    assert (both.value.code, both.value.field) == (Code.INVALID_ARGUMENT, FIELD)
    with pytest.raises(DrafterError) as neither:
        path(_kwargs(with_hidden=False), None)
    assert (neither.value.code, neither.value.field) == (Code.INVALID_ARGUMENT, "target_hidden_states")


BAD = {  # field override -> the field the refusal must name
    "dtype=int32": (dict(dtype="int32"), "dtype"),
    "dtype=float64": (dict(dtype="float64"), "dtype"),
    "3 dims": (dict(shape=[ROWS, WIDTH, 1]), "shape"),
    "negative rows": (dict(shape=[-1, WIDTH]), "shape"),
    "huge rows": (dict(shape=[2**40, WIDTH]), "shape"),
    "column stride 2": (dict(stride=[WIDTH, 2]), "stride"),
    "rows overlap": (dict(stride=[WIDTH - 1, 1]), "stride"),
    "one stride": (dict(stride=[WIDTH]), "stride"),
    "storage too small": (dict(storage_size_bytes=ROWS * WIDTH * 4 - 1), "storage_size_bytes"),
    "storage beyond any GPU": (dict(storage_size_bytes=2**60), "storage_size_bytes"),
    "offset beyond the storage": (dict(storage_offset=1), "storage_size_bytes"),
    "offset huge": (dict(storage_offset=2**40), "storage_offset"),
    "empty handle": (dict(handle=b""), "handle"),
    "63-byte handle": (dict(handle=bytes(63)), "handle"),
    "65-byte handle": (dict(handle=bytes(65)), "handle"),
    "expandable segment": (dict(handle=bytes([2, ord("e")]) + bytes(64)), "handle"),
    "version 0": (dict(handle=bytes([0, ord("c")]) + bytes(64)), "handle"),
    "long garbage": (dict(handle=bytes(range(256)) * 4), "handle"),
    "counter name": (dict(ref_counter_handle="/etc/passwd"), "ref_counter_handle"),
    "counter name suffix": (dict(ref_counter_handle="/torch_1_2_3/../x"), "ref_counter_handle"),
    "counter offset": (dict(ref_counter_offset=10000), "ref_counter_offset"),
    "event short": (dict(event_handle=bytes(10)), "event_handle"),
    "event missing": (dict(event_handle=b""), "event_handle"),
    "step event short": (dict(step_event_handle=bytes(63)), "step_event_handle"),
    "no gpu": (dict(device_uuid=""), "device_uuid"),
    "gpu name unprintable": (dict(device_uuid="GPU-\x00"), "device_uuid"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_fields_are_refused_by_name(case):
    override, field = BAD[case]
    with pytest.raises(DrafterError) as err:
        decode_ref(msgspec.structs.replace(ref_message(ROWS, WIDTH), **override))
    assert (err.value.code, err.value.field) == (Code.INVALID_ARGUMENT, f"{FIELD}.{field}"), err.value.message


@pytest.mark.parametrize("override", [
    dict(handle=bytes(64)),  # torch before versioned handles: a bare cudaIpcMemHandle_t
    dict(handle=bytes([1, ord("c")]) + bytes(64)),
    dict(event_handle=bytes(64), event_sync_required=False),
    dict(event_handle=b"", event_sync_required=False),
    dict(step_event_handle=b""),
    dict(shape=[0, WIDTH], storage_size_bytes=0),
], ids=str)
def test_what_torch_produces_is_accepted(override):
    r = decode_ref(msgspec.structs.replace(ref_message(ROWS, WIDTH), **override))
    assert r.bytes_needed <= r.storage_size_bytes


@pytest.mark.parametrize("version", [1, 2, 3])
def test_the_opened_handle_is_the_bare_cuda_one_whatever_the_torch_version(version):
    payload = bytes(range(64))
    message = ref_message(ROWS, WIDTH)
    versioned = decode_ref(msgspec.structs.replace(message, handle=bytes([version, ord("c")]) + payload))
    legacy = decode_ref(msgspec.structs.replace(message, handle=payload))
    assert versioned.cuda_malloc_handle == legacy.cuda_malloc_handle == payload


def test_bytes_needed_counts_strides_and_offset():
    r = ref(3, 4, torch.float16, row_stride=10, storage_offset=2)
    assert r.bytes_needed == (2 + 2 * 10 + 4) * 2
