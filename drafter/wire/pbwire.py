"""ProposeRequest on the gRPC wire without copying the tensor payloads through protobuf.

protobuf copies a bytes field on parse (into its arena) and again on every read of it (a new
Python bytes object), and on the client once more on assignment and on serialisation: four
copies of a 1.5 MB hidden-state batch per call.  Here:

  * client: `encode_propose_request` serialises the scalar fields and each Tensor's dtype and
    shape with protobuf itself and writes the length-delimited framing around the payloads by
    hand: one b"".join is the only copy (gRPC then copies the bytes into its own buffer);
  * server: `request_from_raw` walks the request's top-level fields and its Tensors' fields, keeps
    every payload as a memoryview of the received bytes, and lets protobuf parse (and validate)
    everything else from a skeleton: the same bytes with the payloads left out.  torch then views
    the received bytes directly.  Anything the walk does not expect (a repeated singular field,
    unknown fields inside a Tensor, a group, a truncated varint) falls back to the full protobuf
    parse, so every malformed request gets exactly the answer it got before.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from drafter._proto.drafter.v1 import drafter_pb2 as pb
from drafter.wire.errors import Code, DrafterError
from drafter.wire.records import ProposeRequest
from drafter.wire.tensors import (LIST_FIELDS, REQUIRED_FIELDS, TENSOR_FIELDS, _build_request, _check_list,
                                  decode_tensor, dtype_name, flat_fields, ipc_from_proto, request_from_proto,
                                  tensor_bytes)

_FIELDS = pb.ProposeRequest.DESCRIPTOR.fields_by_name
_TENSOR_NUMBERS = {_FIELDS[n].number: n for n in (*TENSOR_FIELDS, *LIST_FIELDS)}
_REPEATED = {_FIELDS[n].number for n in LIST_FIELDS}
_KNOWN = {f.number for f in pb.ProposeRequest.DESCRIPTOR.fields}
_MAX_FIELD_NUMBER = (1 << 29) - 1  # protobuf's largest field number
_T = pb.Tensor.DESCRIPTOR.fields_by_name
_DTYPE, _SHAPE, _DATA = _T["dtype"].number, _T["shape"].number, _T["data"].number
LEN = 2  # wire type: length-delimited
# A well-formed request has at most 19 top-level fields plus one per KV group in each list field, and a
# Tensor three fields plus one per dimension (shape packed or not).  The walk stops at these counts, so
# the Python work per request is bounded whatever its size (a request of millions of tiny unknown
# fields used to keep the event loop walking for seconds).
MAX_TOP_FIELDS = 128
MAX_TENSOR_FIELDS = 64


class _Bail(Exception):
    """Not the shape the fast path handles: use the full protobuf parse."""


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_KEYS = {num: _varint_bytes(num << 3 | LEN) for num in _TENSOR_NUMBERS}
_DATA_KEY = _varint_bytes(_DATA << 3 | LEN)


# ------------------------------------------------------------------ client
class EncodedRequest:
    """A serialised ProposeRequest; quacks like the message where gRPC and the load test look at it."""

    __slots__ = ("data", "request_id")

    def __init__(self, data: bytes, request_id: int):
        self.data, self.request_id = data, request_id

    def SerializeToString(self) -> bytes:  # noqa: N802 - protobuf's name
        return self.data

    def ByteSize(self) -> int:  # noqa: N802
        return len(self.data)


def encode_propose_request(request: ProposeRequest) -> EncodedRequest:
    """Client side: the record -> the bytes protobuf would produce for request_to_proto's message (up
    to field order, which no parser minds), with each payload copied once.  hidden_ipc (no payload)
    goes with the scalars."""
    ipc = request.hidden_ipc
    scalars = pb.ProposeRequest(session_id=request.session_id, epoch=request.epoch, request_id=request.request_id,
                                return_probs=request.return_probs, batch_padded=request.batch_padded,
                                tokens_padded=request.tokens_padded,
                                target_hidden_states_ipc=None if ipc is None else
                                ipc.to_wire(pb.CudaIpcTensor)).SerializeToString()
    parts: list = [scalars]
    for name, value in flat_fields(request):
        key = _KEYS[_FIELDS[name].number]
        for t in (value if isinstance(value, list) else [value]):
            meta = pb.Tensor(dtype=dtype_name(t), shape=list(t.shape)).SerializeToString()
            data = tensor_bytes(t)
            head = meta + _DATA_KEY + _varint_bytes(data.nbytes) if data.nbytes else meta
            parts += [key, _varint_bytes(len(head) + data.nbytes), head]
            if data.nbytes:
                parts.append(data)
    return EncodedRequest(b"".join(parts), request.request_id)


# ------------------------------------------------------------------ server
def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Bail
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _skip(buf: bytes, pos: int, end: int, wire: int) -> int:
    if wire == 0:
        return _varint(buf, pos, end)[1]
    if wire == 1:
        pos += 8
    elif wire == 5:
        pos += 4
    elif wire == LEN:
        n, pos = _varint(buf, pos, end)
        pos += n
    else:  # groups (3, 4) and invalid wire types
        raise _Bail
    if pos > end:
        raise _Bail
    return pos


def _tensor(raw: bytes, view: memoryview, pos: int, end: int) -> tuple[bytes, memoryview | None]:
    """A Tensor submessage: (its fields without the payload, the payload as a view of raw)."""
    skeleton = []
    data = None
    seen_dtype = False
    count = 0
    while pos < end:
        count += 1
        if count > MAX_TENSOR_FIELDS:
            raise _Bail  # protobuf's C parser takes it (linear in bytes, no Python per field)
        start = pos
        key, pos = _varint(raw, pos, end)
        num, wire = key >> 3, key & 7
        if num == _DATA and wire == LEN and data is None:
            n, pos = _varint(raw, pos, end)
            if pos + n > end:
                raise _Bail
            data = view[pos:pos + n]
            pos += n
            continue
        if num == _DTYPE and wire == LEN and not seen_dtype:
            seen_dtype = True
        elif num != _SHAPE or wire not in (0, LEN):
            raise _Bail  # a second dtype or payload, an unknown field: protobuf's own rules apply
        pos = _skip(raw, pos, end, wire)
        skeleton.append(raw[start:pos])
    return b"".join(skeleton), data


def _split(raw: bytes) -> tuple[bytes, dict]:
    """(the request without its payloads, {(field number, index): payload view})."""
    view = memoryview(raw)
    end = len(raw)
    skeleton: list = []
    payloads: dict = {}
    counts: dict = {}
    pos = 0
    walked = 0
    while pos < end:
        walked += 1
        if walked > MAX_TOP_FIELDS:
            raise DrafterError(Code.INVALID_ARGUMENT, "request",
                               f"more than {MAX_TOP_FIELDS} top-level fields: not a drafter.v1.ProposeRequest "
                               "this server sent or accepts")
        start = pos
        key, pos = _varint(raw, pos, end)
        num, wire = key >> 3, key & 7
        if num in _TENSOR_NUMBERS:  # noqa: SIM102
            if wire != LEN:
                raise _Bail
            n, pos = _varint(raw, pos, end)
            stop = pos + n
            if stop > end:
                raise _Bail
            index = counts.get(num, 0)
            if index and num not in _REPEATED:
                raise _Bail  # protobuf merges a repeated singular message: leave that to it
            counts[num] = index + 1
            fields, data = _tensor(raw, view, pos, stop)
            skeleton += [_KEYS[num], _varint_bytes(len(fields)), fields]
            payloads[(num, index)] = data
            pos = stop
        else:
            pos = _skip(raw, pos, end, wire)
            # an unknown length-delimited field changes no value of the parsed message and protobuf checks
            # nothing in it but its length (which _skip did): not copied, since a large one cost two copies
            # and a parse on the loop.  Anything else goes to protobuf, which judges its validity.
            if wire != LEN or num in _KNOWN or not 0 < num <= _MAX_FIELD_NUMBER:
                skeleton.append(raw[start:pos])
    return b"".join(skeleton), payloads


def parse_request(raw: bytes) -> pb.ProposeRequest:
    """The full protobuf parse (grpc_server._parse's errors)."""
    try:
        return pb.ProposeRequest.FromString(raw)
    except (DecodeError, ValueError, TypeError) as exc:
        raise DrafterError(Code.INVALID_ARGUMENT, "request", f"not a drafter.v1.ProposeRequest: {exc}") from None


def request_from_raw(raw: bytes) -> ProposeRequest:
    """Server side: the received bytes of a ProposeRequest -> the record, tensors viewing `raw`.

    Same checks, errors and values as request_from_proto(parse_request(raw))."""
    try:
        skeleton, payloads = _split(raw)
        req = pb.ProposeRequest.FromString(skeleton)
    except DrafterError:
        raise  # refused before any more work is spent on it
    except Exception:  # noqa: BLE001 - _Bail or a protobuf error: the authoritative path answers
        return request_from_proto(parse_request(raw))

    def payload(num: int, index: int):
        data = payloads.get((num, index))
        return b"" if data is None else data

    def get_tensor(name, ndim, kind):
        if not req.HasField(name):
            return None
        m = getattr(req, name)
        return decode_tensor(name, m.dtype, m.shape, payload(_FIELDS[name].number, 0), ndim, kind)

    def get_list(name, ndim, kind):
        items = getattr(req, name)
        _check_list(name, items)
        num = _FIELDS[name].number
        return [decode_tensor(f"{name}[{i}]", m.dtype, m.shape, payload(num, i), ndim, kind)
                for i, m in enumerate(items)]

    return _build_request(req.session_id, req.epoch, req.request_id, req.return_probs, req.batch_padded,
                          req.tokens_padded, get_tensor, get_list, ipc_from_proto(req))


__all__ = ["EncodedRequest", "encode_propose_request", "request_from_raw", "parse_request", "REQUIRED_FIELDS"]
