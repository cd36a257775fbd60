"""The ZMQ msgspec schema and the proto describe the same messages, field by field."""

from __future__ import annotations

import msgspec
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD

from drafter._proto.drafter.v1 import drafter_pb2 as pb
from drafter.wire import schema
from drafter.wire.errors import Code

SCALARS = {
    FD.TYPE_UINT32: (int, 0, 2**32 - 1),
    FD.TYPE_UINT64: (int, 0, None),  # msgpack integers end at 2**64 - 1 by themselves
    FD.TYPE_INT64: (int, -(2**63), 2**63 - 1),
    FD.TYPE_STRING: (str, None, None),
    FD.TYPE_BOOL: (bool, None, None),
    FD.TYPE_ENUM: (int, 0, 2**32 - 1),
}


def _repeated(fd) -> bool:
    return fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == FD.LABEL_REPEATED


def _check_type(msg: str, fd, t) -> None:
    where = f"{msg}.{fd.name}"
    if _repeated(fd):
        assert isinstance(t, msgspec.inspect.ListType), f"{where}: repeated in the proto, {t} in msgspec"
        assert t.max_length is not None, f"{where}: lists from the network must be bounded"
        t = t.item_type
    elif fd.type == FD.TYPE_MESSAGE:
        assert isinstance(t, msgspec.inspect.UnionType), f"{where}: optional message expected, got {t}"
        kinds = [x for x in t.types if not isinstance(x, msgspec.inspect.NoneType)]
        assert len(kinds) == 1 and len(t.types) == 2, f"{where}: expected `Struct | None`, got {t}"
        t = kinds[0]
    if fd.type == FD.TYPE_MESSAGE:
        assert isinstance(t, msgspec.inspect.StructType), f"{where}: {t}"
        assert t.cls.__name__ == fd.message_type.name, f"{where}: {t.cls.__name__} vs {fd.message_type.name}"
        return
    if fd.type == FD.TYPE_BYTES:
        # tensor payloads travel in frames; only CudaIpcTensor's small handles may sit in a header
        assert msg == "CudaIpcTensor", f"{where}: bytes may only appear as Tensor.data or in CudaIpcTensor"
        assert isinstance(t, msgspec.inspect.BytesType), f"{where}: bytes in the proto, {t} in msgspec"
        return
    py, low, high = SCALARS[fd.type]
    expected_type = {int: msgspec.inspect.IntType, str: msgspec.inspect.StrType,
                     bool: msgspec.inspect.BoolType}[py]
    assert isinstance(t, expected_type), f"{where}: {fd.type} in the proto, {t} in msgspec"
    if py is int:
        assert (t.ge, t.le) == (low, high), f"{where}: range [{t.ge}, {t.le}] vs proto [{low}, {high}]"


@pytest.mark.parametrize("name", sorted(schema.MESSAGES))
def test_struct_matches_proto_message(name):
    desc = pb.DESCRIPTOR.message_types_by_name[name]
    info = msgspec.inspect.type_info(schema.MESSAGES[name])
    proto_fields = [f.name for f in desc.fields]
    struct_fields = [f.name for f in info.fields]
    if name == "Tensor":  # the one deliberate difference: bytes travel in their own frame
        assert proto_fields == ["dtype", "shape", "data"] and struct_fields == ["dtype", "shape", "frame"]
        proto_fields = proto_fields[:2]
        struct_fields = struct_fields[:2]
    assert struct_fields == proto_fields, f"{name}: fields differ (order included)"
    by_name = {f.name: f for f in info.fields}
    for fd in desc.fields:
        if name == "Tensor" and fd.name == "data":
            continue
        _check_type(name, fd, by_name[fd.name].type)
        assert not by_name[fd.name].required, f"{name}.{fd.name}: proto3 fields are optional, give a default"


def test_every_proto_message_has_a_struct():
    assert set(pb.DESCRIPTOR.message_types_by_name) == set(schema.MESSAGES)


def test_methods_match_the_service():
    service = pb.DESCRIPTOR.services_by_name["Drafter"]
    unary = {m.name: (m.input_type.name, m.output_type.name) for m in service.methods
             if not (m.client_streaming or m.server_streaming)}
    assert unary == {m: (req.__name__, resp.__name__) for m, (req, resp) in schema.METHODS.items()}
    stream = service.methods_by_name["ProposeStream"]
    assert stream.client_streaming and stream.server_streaming
    assert (stream.input_type.name, stream.output_type.name) == ("ProposeRequest", "ProposeResponse")


def test_error_codes_match_the_proto_enum():
    enum = pb.DESCRIPTOR.enum_types_by_name["ErrorCode"]
    assert {v.name: v.number for v in enum.values} == {c.name: int(c) for c in Code}
