"""Malformed propose messages with the error each must get, for fuzzing both transports.

A Msg is a propose request at the wire level (tensors as dtype, shape, raw bytes); every
mutation breaks one thing of a valid template and returns the (code, field) the server has to
answer with, worked out from the documented validation order: wire decode -> epoch -> session
-> the session's limits -> the engine's checks.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field

import msgspec
import torch

from drafter._proto.drafter.v1 import drafter_pb2 as pb
from drafter.wire import schema
from drafter.wire.cuda_ref import FIELD as IPC
from drafter.wire.tensors import DTYPE_NAMES, DTYPES, LIST_FIELDS, TENSOR_FIELDS, tensor_bytes
from tests.support.cuda_refs import ref_message

IA, FP, NF = "INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND"


@dataclass
class Ctx:
    epoch: int
    session_id: str
    vocab: int
    max_model_len: int
    session_blocks: int
    block_size: int
    k: int
    max_num_seqs: int  # the session's
    max_tokens: int  # the session's
    hidden_width: int
    cuda_ipc: bool = False  # whether the server opens CUDA IPC references (never on a CPU server)


@dataclass
class Msg:
    session_id: str
    epoch: int
    request_id: int = 0
    tensors: dict = field(default_factory=dict)  # name -> (dtype, shape, bytes)
    lists: dict = field(default_factory=dict)  # name -> [(dtype, shape, bytes)]
    return_probs: bool = False
    batch_padded: int = 0
    tokens_padded: int = 0
    ipc: dict | None = None  # target_hidden_states_ipc's fields (CudaIpcTensor)

    def to_proto(self) -> bytes:
        req = pb.ProposeRequest(session_id=self.session_id, epoch=self.epoch, request_id=self.request_id,
                                return_probs=self.return_probs, batch_padded=self.batch_padded,
                                tokens_padded=self.tokens_padded)
        if self.ipc is not None:
            req.target_hidden_states_ipc.CopyFrom(pb.CudaIpcTensor(**self.ipc))
        for name, (dt, shape, data) in self.tensors.items():
            t = getattr(req, name)
            t.dtype, t.data = dt, data
            t.shape[:] = shape
        for name, items in self.lists.items():
            for dt, shape, data in items:
                t = getattr(req, name).add()
                t.dtype, t.data = dt, data
                t.shape[:] = shape
        return req.SerializeToString()

    def to_zmq_header(self) -> tuple[dict, list[bytes]]:
        frames: list[bytes] = []

        def ref(item):
            frames.append(item[2])
            return {"dtype": item[0], "shape": list(item[1]), "frame": len(frames) - 1}
        header = {"session_id": self.session_id, "epoch": self.epoch, "request_id": self.request_id,
                  "return_probs": self.return_probs, "batch_padded": self.batch_padded,
                  "tokens_padded": self.tokens_padded}
        for name, item in self.tensors.items():
            header[name] = ref(item)
        for name, items in self.lists.items():
            header[name] = [ref(i) for i in items]
        if self.ipc is not None:
            header[IPC] = dict(self.ipc)
        return header, frames


def encode(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    return DTYPE_NAMES[t.dtype], list(t.shape), bytes(tensor_bytes(t))


def template(kwargs: dict, ctx: Ctx) -> Msg:
    msg = Msg(ctx.session_id, ctx.epoch)
    for name in TENSOR_FIELDS:
        if kwargs.get(name) is not None:
            msg.tensors[name] = encode(kwargs[name])
    for name in LIST_FIELDS:
        msg.lists[name] = [encode(t) for t in kwargs[name]]
    return msg


# ------------------------------------------------------------------ helpers
def _from(dt: str, shape, data: bytes) -> torch.Tensor:
    """A writable copy of a wire tensor."""
    if not data:
        return torch.empty(shape, dtype=DTYPES[dt])
    return torch.frombuffer(bytearray(data), dtype=DTYPES[dt]).view(shape).clone()


def _get(msg: Msg, name: str) -> torch.Tensor:
    return _from(*msg.tensors[name])


def _put(msg: Msg, name: str, t: torch.Tensor) -> None:
    msg.tensors[name] = encode(t)


def _slots(msg: Msg) -> list[tuple[str, tuple]]:
    """(field name, location) of every tensor in the message."""
    out = [(n, ("t", n)) for n in msg.tensors]
    for n, items in msg.lists.items():
        out += [(f"{n}[{i}]", ("l", n, i)) for i in range(len(items))]
    return out


def _read(msg, loc):
    return msg.tensors[loc[1]] if loc[0] == "t" else msg.lists[loc[1]][loc[2]]


def _write(msg, loc, item):
    if loc[0] == "t":
        msg.tensors[loc[1]] = item
    else:
        msg.lists[loc[1]][loc[2]] = item


def _batch(msg) -> int:
    return msg.tensors["next_token_ids"][1][0]


def _tokens(msg) -> int:
    return msg.tensors["target_token_ids"][1][0]


# ------------------------------------------------------------------ wire-level mutations
def bad_dtype(msg, rnd, ctx):
    name, loc = rnd.choice(_slots(msg))
    dt, shape, data = _read(msg, loc)
    _write(msg, loc, (rnd.choice(["float64", "int8", "uint8", "bool", "", "complex64", "Int32", "int 32",
                                  "".join(rnd.choices("abcxyz0123", k=rnd.randint(1, 12)))]), shape, data))
    return IA, name


def wrong_kind(msg, rnd, ctx):
    name, loc = rnd.choice(_slots(msg))
    dt, shape, data = _read(msg, loc)
    t = torch.zeros(shape)
    kind_is_float = loc[0] == "t" and loc[1] in ("target_hidden_states", "temperatures")
    t = t.to(rnd.choice([torch.int32, torch.int64])) if kind_is_float else \
        t.to(rnd.choice([torch.float32, torch.float16, torch.bfloat16]))
    _write(msg, loc, encode(t))
    return IA, name


def byte_mismatch(msg, rnd, ctx):
    name, loc = rnd.choice(_slots(msg))
    dt, shape, data = _read(msg, loc)
    how = rnd.randrange(3)
    if how == 0:
        data = data + bytes(rnd.randint(1, 7))
    elif how == 1 and data:
        data = data[:-rnd.randint(1, len(data))]
    else:
        shape = list(shape)
        shape[rnd.randrange(len(shape))] += rnd.choice([1, 2, 1000, 2**20])
    _write(msg, loc, (dt, shape, data))
    return IA, name


def wrong_ndim(msg, rnd, ctx):
    name, loc = rnd.choice(_slots(msg))
    dt, shape, data = _read(msg, loc)
    shape = [math.prod(shape)] if len(shape) == 2 else list(shape) + [1] * rnd.randint(1, 3)
    _write(msg, loc, (dt, shape, data))
    return IA, name


def negative_dim(msg, rnd, ctx):
    name, loc = rnd.choice(_slots(msg))
    dt, shape, data = _read(msg, loc)
    shape = list(shape)
    shape[rnd.randrange(len(shape))] = rnd.choice([-1, -2**31, -(2**62)])
    _write(msg, loc, (dt, shape, data))
    return IA, name


def missing_required(msg, rnd, ctx):
    name = rnd.choice(["target_token_ids", "target_positions", "target_hidden_states", "next_token_ids",
                       "query_start_loc", "seq_lens"])
    del msg.tensors[name]
    return IA, name


def bad_group_list(msg, rnd, ctx):
    name = rnd.choice(list(LIST_FIELDS))
    msg.lists[name] = [] if rnd.random() < 0.5 else msg.lists[name] * 17
    return IA, name


# ------------------------------------------------------------------ session
def bad_epoch(msg, rnd, ctx):
    msg.epoch = ctx.epoch ^ rnd.randint(1, 2**64 - 1)
    if rnd.random() < 0.3:
        msg.session_id = "%032x" % rnd.getrandbits(128)  # the epoch is checked first
    return FP, "epoch"


def unknown_session(msg, rnd, ctx):
    msg.session_id = rnd.choice(["", "%032x" % rnd.getrandbits(128), ctx.session_id + "0", ctx.session_id[:-1]])
    return NF, "session_id"


# ------------------------------------------------------------------ the session's limits
def empty_batch(msg, rnd, ctx):
    _put(msg, "next_token_ids", torch.zeros(0, dtype=torch.int32))
    return IA, "next_token_ids"


def too_many_seqs(msg, rnd, ctx):
    _put(msg, "next_token_ids", torch.zeros(ctx.max_num_seqs + rnd.randint(1, 5), dtype=torch.int32))
    return IA, "next_token_ids"


def too_many_tokens(msg, rnd, ctx):
    _put(msg, "target_token_ids", torch.zeros(ctx.max_tokens + rnd.randint(1, 50), dtype=torch.int32))
    return IA, "target_token_ids"


def hidden_dtype_mismatch(msg, rnd, ctx):
    _put(msg, "target_hidden_states", _get(msg, "target_hidden_states").to(rnd.choice([torch.float16,
                                                                                       torch.bfloat16])))
    return IA, "target_hidden_states"


def position_out_of_range(msg, rnd, ctx):
    pos = _get(msg, "target_positions")
    pos[rnd.randrange(len(pos))] = rnd.choice([ctx.max_model_len + rnd.randint(0, 1000), -rnd.randint(1, 2**40)])
    _put(msg, "target_positions", pos)
    return IA, "target_positions"


def seq_len_out_of_range(msg, rnd, ctx):
    s = _get(msg, "seq_lens")
    s[rnd.randrange(len(s))] = rnd.choice([0, -5, ctx.max_model_len + rnd.randint(1, 1000)])
    _put(msg, "seq_lens", s)
    return IA, "seq_lens"


def extra_group(msg, rnd, ctx):
    name = rnd.choice(list(LIST_FIELDS))
    msg.lists[name] = msg.lists[name] * rnd.randint(2, 4)
    return IA, "block_tables" if name == "block_tables" else "slot_mappings"


def block_id_out_of_range(msg, rnd, ctx):
    dt, shape, data = msg.lists["block_tables"][0]
    t = _from(dt, shape, data)
    if t.numel() == 0:
        return wrong_ndim(msg, rnd, ctx)
    t.view(-1)[rnd.randrange(t.numel())] = rnd.choice([ctx.session_blocks + rnd.randint(0, 10**6), -1,
                                                        -rnd.randint(2, 2**31)])
    msg.lists["block_tables"][0] = encode(t)
    return IA, "block_tables[0]"


def slot_out_of_range(msg, rnd, ctx):
    dt, shape, data = msg.lists["slot_mappings"][0]
    t = _from(dt, shape, data)
    t[rnd.randrange(len(t))] = rnd.choice([ctx.session_blocks * ctx.block_size + rnd.randint(0, 10**6),
                                           -2 - rnd.randint(0, 2**31)])
    msg.lists["slot_mappings"][0] = encode(t)
    return IA, "slot_mappings[0]"


def accepted_bad(msg, rnd, ctx):
    b = _batch(msg)
    how = rnd.randrange(3)
    if how == 0:
        t = torch.zeros(b, dtype=torch.int64)
        t[rnd.randrange(b)] = ctx.k + rnd.randint(1, 100)
    elif how == 1:
        t = torch.zeros(b, dtype=torch.int64)
        t[rnd.randrange(b)] = -rnd.randint(2, 100)
    else:
        t = torch.zeros(b + rnd.randint(1, 3), dtype=torch.int32)
    _put(msg, "accepted_counts", t)
    return IA, "accepted_counts"


def bad_padded_sizes(msg, rnd, ctx):
    if rnd.random() < 0.5:
        msg.batch_padded = rnd.choice([_batch(msg) - 1, 1000 + rnd.randint(0, 10**6)]) or 1
        if msg.batch_padded == _batch(msg):
            msg.batch_padded = 10**6
        return IA, "batch_padded"
    msg.tokens_padded = rnd.choice([_tokens(msg) - 1, 10**5 + rnd.randint(0, 10**6)]) or 10**6
    return IA, "tokens_padded"


# ------------------------------------------------------------------ the engine's checks
def token_id_out_of_range(msg, rnd, ctx):
    name = rnd.choice(["target_token_ids", "next_token_ids"])
    t = _get(msg, name)
    t[rnd.randrange(len(t))] = rnd.choice([ctx.vocab + rnd.randint(0, 10**6), -rnd.randint(1, 2**31 - 1)])
    _put(msg, name, t)
    return IA, name


def positions_inconsistent(msg, rnd, ctx):
    pos = _get(msg, "target_positions")
    if rnd.random() < 0.5:
        j = rnd.randrange(len(pos))
        pos[j] = (int(pos[j]) + rnd.randint(1, 5)) % ctx.max_model_len
        _put(msg, "target_positions", pos)
    else:
        _put(msg, "target_positions", pos[:-1])
    return IA, "target_positions"


def qsl_bad(msg, rnd, ctx):
    q = _get(msg, "query_start_loc")
    how = rnd.randrange(4)
    if how == 0:
        q[0] = rnd.randint(1, 3)
    elif how == 1:
        q[-1] = int(q[-1]) + rnd.choice([-1, 1, 100])
    elif how == 2:
        q[1] = q[0]  # an empty request
    else:
        q = torch.cat([q, q[-1:]])  # one entry too many
    _put(msg, "query_start_loc", q)
    return IA, "query_start_loc"


def seq_lens_inconsistent(msg, rnd, ctx):
    s = _get(msg, "seq_lens")
    q = _get(msg, "query_start_loc")
    if rnd.random() < 0.5:
        r = max(range(len(s)), key=lambda i: int(q[i + 1] - q[i]))  # a request with query_len >= 2
        s[r] = max(1, int(q[r + 1] - q[r]) - rnd.randint(1, 3))
    else:
        s = torch.cat([s, s[-1:]])
    _put(msg, "seq_lens", s)
    return IA, "seq_lens"


def hidden_bad(msg, rnd, ctx):
    h = _get(msg, "target_hidden_states")
    how = rnd.randrange(3)
    if how == 0:
        h = torch.zeros(h.shape[0], ctx.hidden_width + rnd.choice([-1, 1, 64]))
    elif how == 1:
        h = h[:-1] if rnd.random() < 0.5 else torch.cat([h, h[-1:]])
    else:
        h[rnd.randrange(h.shape[0]), rnd.randrange(h.shape[1])] = rnd.choice([float("nan"), float("inf"),
                                                                               float("-inf")])
    _put(msg, "target_hidden_states", h)
    return IA, "target_hidden_states"


def rejected_bad(msg, rnd, ctx):
    q = _get(msg, "query_start_loc")
    b = len(q) - 1
    t = torch.zeros(b, dtype=torch.int32)
    r = rnd.randrange(b)
    t[r] = rnd.choice([int(q[r + 1] - q[r]) + rnd.randint(0, 5), -rnd.randint(1, 5)])
    if rnd.random() < 0.2:
        t = torch.zeros(b + 1, dtype=torch.int32)
    _put(msg, "num_rejected_tokens", t)
    return IA, "num_rejected_tokens"


def sample_index_bad(msg, rnd, ctx):
    q = _get(msg, "query_start_loc")
    idx = q[1:].clone() - 1
    r = rnd.randrange(len(idx))
    idx[r] = rnd.choice([int(q[r + 1]) + rnd.randint(0, 5), int(q[r]) - rnd.randint(1, 5)])
    _put(msg, "token_indices_to_sample", idx)
    return IA, "token_indices_to_sample"


def temperatures_bad(msg, rnd, ctx):
    b = _batch(msg)
    t = torch.zeros(b)
    how = rnd.randrange(3)
    if how == 0:
        t[rnd.randrange(b)] = -rnd.random() - 1e-3
    elif how == 1:
        t[rnd.randrange(b)] = rnd.choice([float("nan"), float("inf")])
    else:
        t = torch.zeros(b + rnd.randint(1, 3))
    _put(msg, "temperatures", t)
    return IA, "temperatures"


def kv_shape_bad(msg, rnd, ctx):
    how = rnd.randrange(4)
    dt, shape, data = msg.lists["block_tables"][0]
    table = _from(dt, shape, data)
    dt, shape, data = msg.lists["slot_mappings"][0]
    slots = _from(dt, shape, data)
    if how == 0:
        msg.lists["block_tables"][0] = encode(table[:, :0])  # no columns: cannot reach any position
        return IA, "block_tables[0]"
    if how == 1:
        msg.lists["block_tables"][0] = encode(torch.cat([table, table[-1:]]))  # a row too many
        return IA, "block_tables[0]"
    if how == 2:
        j = rnd.randrange(len(slots))
        slots[j] = (int(slots[j]) + rnd.randint(1, 15)) % (ctx.session_blocks * ctx.block_size)
        msg.lists["slot_mappings"][0] = encode(slots)  # in range, but not where block_tables says
        return IA, "slot_mappings[0]"
    msg.lists["slot_mappings"][0] = encode(torch.cat([slots, slots[-1:]]))
    return IA, "slot_mappings[0]"


# ------------------------------------------------------------------ CUDA IPC references
def _ipc_for(msg, rnd) -> dict:
    """A well-formed reference for the message's hidden states (its handle: random bytes)."""
    dt, shape, _ = msg.tensors["target_hidden_states"]
    m = ref_message(*shape, DTYPES[dt], seed=rnd.randrange(256))
    handle = rnd.choice([bytes(rnd.getrandbits(8) for _ in range(64)), bytes([2, ord("c")]) + bytes(64)])
    return {**msgspec.structs.asdict(m), "handle": handle}


def _unsupported(ctx) -> tuple[str, str]:
    # a CPU server refuses any well-formed reference (after epoch and session); a GPU server cannot
    # read the made-up GPU the reference names
    return IA, (f"{IPC}.device_uuid" if ctx.cuda_ipc else IPC)


def ipc_and_bytes(msg, rnd, ctx):
    msg.ipc = _ipc_for(msg, rnd)
    return IA, IPC


def ipc_instead_of_bytes(msg, rnd, ctx):
    msg.ipc = _ipc_for(msg, rnd)
    del msg.tensors["target_hidden_states"]
    if rnd.random() < 0.3:  # rows that disagree with the call: still the refusal of the reference first
        msg.ipc["shape"] = [msg.ipc["shape"][0] + 1, msg.ipc["shape"][1]]
        msg.ipc["storage_size_bytes"] *= 2
    return _unsupported(ctx)


IPC_BREAKS = [  # (field, value); every one makes the reference malformed on its own
    ("dtype", "int32"), ("dtype", ""), ("shape", [1, 2, 3]), ("shape", [-1, 8]), ("stride", [1, 1]),
    ("stride", [8]), ("storage_size_bytes", 1), ("storage_offset", 2**40), ("handle", b""), ("handle", bytes(65)),
    ("handle", bytes([2, ord("e")]) + bytes(64)), ("ref_counter_handle", "/dev/shm/x"),
    ("ref_counter_handle", ""), ("ref_counter_offset", 10**4), ("ref_counter_offset", 2**63),
    ("event_handle", bytes(3)), ("step_event_handle", bytes(100)), ("device_uuid", ""),
]


def ipc_malformed(msg, rnd, ctx):
    msg.ipc = _ipc_for(msg, rnd)
    del msg.tensors["target_hidden_states"]
    name, value = rnd.choice(IPC_BREAKS)
    msg.ipc[name] = value
    if rnd.random() < 0.3:
        msg.epoch ^= 1  # the reference is decoded (and refused) before the epoch is looked at
    return IA, f"{IPC}.{name}"


MUTATIONS = [
    bad_dtype, wrong_kind, byte_mismatch, wrong_ndim, negative_dim, missing_required, bad_group_list,
    bad_epoch, unknown_session, empty_batch, too_many_seqs, too_many_tokens, hidden_dtype_mismatch,
    position_out_of_range, seq_len_out_of_range, extra_group, block_id_out_of_range, slot_out_of_range,
    accepted_bad, bad_padded_sizes, token_id_out_of_range, positions_inconsistent, qsl_bad, seq_lens_inconsistent,
    hidden_bad, rejected_bad, sample_index_bad, temperatures_bad, kv_shape_bad,
    ipc_and_bytes, ipc_instead_of_bytes, ipc_malformed,
]


def mutate(base: Msg, which: int, seed: int, ctx: Ctx) -> tuple[Msg, str, str]:
    msg = copy.deepcopy(base)
    rnd = random.Random(seed)
    code, field_name = MUTATIONS[which % len(MUTATIONS)](msg, rnd, ctx)
    msg.request_id = seed
    return msg, code, field_name


# ------------------------------------------------------------------ ZMQ header type confusion
WRONG_VALUES = {
    "str": [5, 1.5, True, [], {}, None, b"\x00"],
    "int": ["7", 1.5, True, [], {}, None, -1],
    "u32": [2**32, 2**40],
    "bool": [1, "true", [], None],
    "tensor": [5, "x", [], True, {"dtype": 5}, {"shape": "x"}, {"shape": [1.5]}, {"frame": -1}, {"frame": "0"},
               {"bogus": 1}, {"shape": [0] * 9}],
    "list": ["x", 5, {}, True, [5], ["x"], [{"dtype": []}], [{"shape": {}}]],
    "ipc": [5, "x", [], True, b"\x00" * 64, {"handle": 5}, {"handle": "x"}, {"shape": "x"}, {"bogus": 1},
            {"event_sync_required": "yes"}, {"storage_size_bytes": -1}, {"ref_counter_offset": -1}],
}
KINDS = {"session_id": "str", "epoch": "int", "request_id": "int", "return_probs": "bool",
         "batch_padded": "u32", "tokens_padded": "u32",
         **{n: "tensor" for n in TENSOR_FIELDS}, **{n: "list" for n in LIST_FIELDS}, IPC: "ipc"}


def confuse_header(header: dict, rnd: random.Random) -> tuple[dict, str]:
    """One field of a ZMQ header given a value of the wrong type; returns the field to blame."""
    header = copy.deepcopy(header)
    if rnd.random() < 0.08:
        name = rnd.choice(["bogus", "hidden", "data", "Session_id", "block_table"])
        header[name] = 1
        return header, name
    name = rnd.choice(list(KINDS))
    kind = KINDS[name]
    values = WRONG_VALUES[kind] + (WRONG_VALUES["int"] if kind == "u32" else [])
    value = rnd.choice(values)
    header[name] = value
    if kind == "list" and isinstance(value, list) and value:
        return header, f"{name}[0]"
    return header, name


def encode_header(header: dict) -> bytes:
    return msgspec.msgpack.encode(header)


def zmq_envelope(method: str = "Propose", call_id: int = 1, **extra) -> bytes:
    return msgspec.msgpack.encode(schema.Envelope(call_id=call_id, method=method, **extra))
