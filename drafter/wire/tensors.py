"""Tensors and messages on the wire: {dtype, shape, raw bytes} <-> torch, proto <-> msgspec.

Every tensor is checked before torch sees its bytes: dtype on an allow-list and of the kind
the field needs (integer ids, float states), the field's number of dimensions, non-negative
bounded sizes, and product(shape) * itemsize == len(bytes) exactly.  Decoding never copies
what it does not have to: torch.frombuffer views the protobuf bytes or the ZMQ frame.
"""

from __future__ import annotations

import math
import warnings

import msgspec
import torch

from drafter.wire import schema
from drafter.wire.cuda_ref import FIELD as IPC_FIELD
from drafter.wire.cuda_ref import decode_ref
from drafter.wire.errors import invalid
from drafter.wire.records import ProposeInputs, ProposeRequest, ProposeResult

# Request buffers are read-only (protobuf bytes, received frames) and nothing downstream writes into
# request tensors. torch warns about that once per process: spend the warning here, silenced.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)

DTYPES = {
    "int32": torch.int32,
    "int64": torch.int64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# wire dtype -> (torch dtype, floating point?, itemsize)
_SPECS = {name: (td, td.is_floating_point, td.itemsize) for name, td in DTYPES.items()}
INT, FLOAT = "int", "float"
MAX_DIM = 2**31 - 1

# field -> (ndim, kind); the engine's names, so errors name what vLLM's proposer calls them
TENSOR_FIELDS = {
    "target_token_ids": (1, INT),  # [num_tokens]
    "target_positions": (1, INT),  # [num_tokens]
    "target_hidden_states": (2, FLOAT),  # [num_tokens, hidden_width]
    "next_token_ids": (1, INT),  # [batch]
    "query_start_loc": (1, INT),  # [batch + 1]
    "seq_lens": (1, INT),  # [batch]
    "token_indices_to_sample": (1, INT),  # [batch]
    "num_rejected_tokens": (1, INT),  # [batch]
    "temperatures": (1, FLOAT),  # [batch]
    "accepted_counts": (1, INT),  # [batch]
}
REQUIRED_FIELDS = ("target_token_ids", "target_positions", "target_hidden_states", "next_token_ids",
                   "query_start_loc", "seq_lens")
LIST_FIELDS = {"block_tables": (2, INT), "slot_mappings": (1, INT)}  # per KV group
MAX_GROUPS = 16


def decode_tensor(name: str, dtype: str, shape, buf, ndim: int, kind: str) -> torch.Tensor:
    spec = _SPECS.get(dtype)
    if spec is None:
        raise invalid(name, f"dtype {dtype!r} not allowed; expected one of {sorted(DTYPES)}")
    td, is_float, itemsize = spec
    if (kind == INT) == is_float:
        raise invalid(name, f"dtype {dtype} is not an {'integer' if kind == INT else 'float'} type")
    if type(shape) is not list:
        shape = list(shape)
    if len(shape) != ndim:
        raise invalid(name, f"expected {ndim} dimensions, got shape {shape}")
    if shape and (min(shape) < 0 or max(shape) > MAX_DIM):
        raise invalid(name, f"sizes must lie in [0, {MAX_DIM}], got shape {shape}")
    count = math.prod(shape)
    nbytes = count * itemsize
    have = buf.nbytes if type(buf) is memoryview else len(buf) if isinstance(buf, (bytes, bytearray)) \
        else memoryview(buf).nbytes
    if nbytes != have:
        raise invalid(name, f"shape {shape} x {dtype} needs {nbytes} bytes, got {have}")
    if nbytes == 0:
        return torch.empty(shape, dtype=td)
    # a view of the buffer (no copy), and one call cheaper than numpy's frombuffer + torch.from_numpy
    t = torch.frombuffer(buf, dtype=td, count=count)
    if t.data_ptr() % itemsize:  # small ZMQ frames may sit unaligned inside the message struct
        t = t.clone()
    return t.view(shape) if ndim != 1 else t


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (a flat byte view) without a copy where it already is contiguous on the CPU."""
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits travel
        t = t.view(torch.int16)
    a = t.detach().numpy()
    return memoryview(a.reshape(-1)).cast("B") if a.ndim != 1 else memoryview(a).cast("B")


def dtype_name(t: torch.Tensor) -> str:
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise invalid("tensor", f"dtype {t.dtype} cannot travel on the wire")
    return name


# ------------------------------------------------------------------ decoded requests
def _build_request(session_id, epoch, request_id, return_probs, batch_padded, tokens_padded, get_tensor,
                   get_list, ipc_message) -> ProposeRequest:
    """ipc_message: the request's CudaIpcTensor (either representation), None when unset."""
    tensors = {}
    hidden_ipc = None
    for name, (ndim, kind) in TENSOR_FIELDS.items():
        t = get_tensor(name, ndim, kind)
        if name == "target_hidden_states" and ipc_message is not None:
            if t is not None:
                raise invalid(IPC_FIELD, "set target_hidden_states or target_hidden_states_ipc, not both")
            hidden_ipc = decode_ref(ipc_message)
            tensors[name] = None
            continue
        if t is None and name in REQUIRED_FIELDS:
            raise invalid(name, "missing")
        tensors[name] = t
    for name, (ndim, kind) in LIST_FIELDS.items():
        tensors[name] = get_list(name, ndim, kind)
    accepted = tensors.pop("accepted_counts")
    return ProposeRequest(ProposeInputs(**tensors), accepted, bool(return_probs), batch_padded, tokens_padded,
                          hidden_ipc, session_id, epoch, request_id)


def _check_list(name: str, items) -> None:
    if not items:
        raise invalid(name, "missing: one tensor per KV group")
    if len(items) > MAX_GROUPS:
        raise invalid(name, f"{len(items)} entries; at most {MAX_GROUPS} KV groups")


# ------------------------------------------------------------------ protobuf (gRPC)
def request_from_proto(req) -> ProposeRequest:
    def get_tensor(name, ndim, kind):
        if not req.HasField(name):
            return None
        m = getattr(req, name)
        return decode_tensor(name, m.dtype, m.shape, m.data, ndim, kind)

    def get_list(name, ndim, kind):
        items = getattr(req, name)
        _check_list(name, items)
        return [decode_tensor(f"{name}[{i}]", m.dtype, m.shape, m.data, ndim, kind) for i, m in enumerate(items)]

    return _build_request(req.session_id, req.epoch, req.request_id, req.return_probs, req.batch_padded,
                          req.tokens_padded, get_tensor, get_list, ipc_from_proto(req))


def ipc_from_proto(req):
    """The request's CudaIpcTensor message, None when unset."""
    return req.target_hidden_states_ipc if req.HasField(IPC_FIELD) else None


def tensor_to_proto(t: torch.Tensor, pb_tensor) -> None:
    pb_tensor.dtype = dtype_name(t)  # first: a dtype that cannot travel is refused before any copy
    pb_tensor.shape[:] = list(t.shape)
    pb_tensor.data = tensor_bytes(t).tobytes()


def tensor_from_proto(name: str, m) -> torch.Tensor:
    """Decode a tensor the server sent back (client side), with the same checks."""
    dt = DTYPES.get(m.dtype)
    kind = FLOAT if dt is not None and dt.is_floating_point else INT
    return decode_tensor(name, m.dtype, m.shape, m.data, len(m.shape), kind)


def result_to_proto(result: ProposeResult, pb_cls):
    resp = pb_cls(request_id=result.request_id, batch_padded=result.batch_padded,
                  tokens_padded=result.tokens_padded)
    tensor_to_proto(result.draft_token_ids, resp.draft_token_ids)
    if result.draft_probs is not None:
        tensor_to_proto(result.draft_probs, resp.draft_probs)
    return resp


def request_to_proto(pb_cls, request: ProposeRequest):
    """Client side: the record -> a ProposeRequest message (its hidden_ipc instead of hidden states)."""
    req = pb_cls(session_id=request.session_id, epoch=request.epoch, request_id=request.request_id,
                 return_probs=request.return_probs, batch_padded=request.batch_padded,
                 tokens_padded=request.tokens_padded)
    if request.hidden_ipc is not None:
        req.target_hidden_states_ipc.CopyFrom(request.hidden_ipc.to_wire(type(req.target_hidden_states_ipc)))
    for name, value in flat_fields(request):
        if isinstance(value, list):
            for t in value:
                tensor_to_proto(t, getattr(req, name).add())
        else:
            tensor_to_proto(value, getattr(req, name))
    return req


def flat_fields(request: ProposeRequest):
    """(wire field, tensor or list of tensors) of every tensor the request carries, in wire order."""
    inputs = request.inputs
    for name in TENSOR_FIELDS:
        value = request.accepted_counts if name == "accepted_counts" else getattr(inputs, name)
        if value is not None:
            yield name, value
    for name in LIST_FIELDS:
        value = getattr(inputs, name)
        if value is not None:
            yield name, value


# ------------------------------------------------------------------ msgspec + frames (ZMQ)
def request_from_frames(header: schema.ProposeRequest, frames: list) -> ProposeRequest:
    """frames: the tensor frames (zmq.Frame or bytes-like), indexed by Tensor.frame."""

    def buffer(name: str, ref: schema.Tensor):
        if ref.frame >= len(frames):
            raise invalid(name, f"frame {ref.frame} does not exist ({len(frames)} tensor frames)")
        f = frames[ref.frame]
        return f.buffer if hasattr(f, "buffer") else f

    def get_tensor(name, ndim, kind):
        ref = getattr(header, name)
        if ref is None:
            return None
        return decode_tensor(name, ref.dtype, ref.shape, buffer(name, ref), ndim, kind)

    def get_list(name, ndim, kind):
        items = getattr(header, name)
        _check_list(name, items)
        return [decode_tensor(f"{name}[{i}]", r.dtype, r.shape, buffer(f"{name}[{i}]", r), ndim, kind)
                for i, r in enumerate(items)]

    request = _build_request(header.session_id, header.epoch, header.request_id, header.return_probs,
                             header.batch_padded, header.tokens_padded, get_tensor, get_list,
                             header.target_hidden_states_ipc)
    request.want_predrafts = header.want_predrafts
    return request


def tensor_to_frames(t: torch.Tensor, frames: list) -> schema.Tensor:
    name = dtype_name(t)  # first: a dtype that cannot travel is refused before any copy
    frames.append(tensor_bytes(t))
    return schema.Tensor(dtype=name, shape=list(t.shape), frame=len(frames) - 1)


def tensor_from_frames(name: str, ref: schema.Tensor, frames: list) -> torch.Tensor:
    if ref.frame >= len(frames):
        raise invalid(name, f"frame {ref.frame} does not exist")
    f = frames[ref.frame]
    dt = DTYPES.get(ref.dtype)
    kind = FLOAT if dt is not None and dt.is_floating_point else INT
    return decode_tensor(name, ref.dtype, ref.shape, f.buffer if hasattr(f, "buffer") else f, len(ref.shape), kind)


def result_to_frames(result: ProposeResult) -> tuple[schema.ProposeResponse, list]:
    frames: list = []
    header = schema.ProposeResponse(
        request_id=result.request_id, batch_padded=result.batch_padded, tokens_padded=result.tokens_padded,
        draft_token_ids=tensor_to_frames(result.draft_token_ids, frames),
        draft_probs=None if result.draft_probs is None else tensor_to_frames(result.draft_probs, frames))
    return header, frames


def request_to_frames(request: ProposeRequest) -> tuple[schema.ProposeRequest, list]:
    """Client side: the record -> (header Struct, tensor frames); a hidden_ipc reference rides in the
    header (a few hundred bytes: no frame)."""
    frames: list = []
    values = {}
    if request.hidden_ipc is not None:
        values[IPC_FIELD] = request.hidden_ipc.to_wire(schema.CudaIpcTensor)
    for name, value in flat_fields(request):
        if isinstance(value, list):
            values[name] = [tensor_to_frames(t, frames) for t in value]
        else:
            values[name] = tensor_to_frames(value, frames)
    header = schema.ProposeRequest(session_id=request.session_id, epoch=request.epoch, request_id=request.request_id,
                                   return_probs=request.return_probs, batch_padded=request.batch_padded,
                                   tokens_padded=request.tokens_padded, want_predrafts=request.want_predrafts,
                                   **values)
    return header, frames


# ------------------------------------------------------------------ proto <-> Struct (no tensors)
def struct_to_proto(obj: msgspec.Struct, pb):
    """Fill protobuf message `pb` from a schema Struct with the same fields; return pb."""
    for name in obj.__struct_fields__:
        value = getattr(obj, name)
        if value is None:
            continue
        target = getattr(pb, name)
        if isinstance(value, msgspec.Struct):
            struct_to_proto(value, target)
        elif isinstance(value, list):
            del target[:]
            for item in value:
                if isinstance(item, msgspec.Struct):
                    struct_to_proto(item, target.add())
                else:
                    target.append(item)
        else:
            setattr(pb, name, value)
    return pb


def struct_from_proto(pb, cls):
    """The schema Struct `cls` holding the same values as protobuf message `pb`."""
    values = {}
    hints = {f.name: f for f in msgspec.structs.fields(cls)}
    for name, info in hints.items():
        fd = pb.DESCRIPTOR.fields_by_name[name]
        if fd.message_type is not None and not _is_repeated(fd):
            if pb.HasField(name):
                values[name] = struct_from_proto(getattr(pb, name), schema.MESSAGES[fd.message_type.name])
        elif fd.message_type is not None:
            sub = schema.MESSAGES[fd.message_type.name]
            values[name] = [struct_from_proto(m, sub) for m in getattr(pb, name)]
        elif _is_repeated(fd):
            values[name] = list(getattr(pb, name))
        else:
            values[name] = getattr(pb, name)
    return cls(**values)


def _is_repeated(fd) -> bool:
    if hasattr(fd, "is_repeated"):  # protobuf >= 5.29; `label` is deprecated there
        return fd.is_repeated
    return fd.label == fd.LABEL_REPEATED
