"""The ZMQ transport's messages: msgspec Structs mirroring proto/drafter/v1/drafter.proto.

Field names, order and value ranges equal the proto's (tests/unit/test_service_schema.py checks
them field by field).  The one difference: a Tensor's bytes never sit inside the msgpack header;
`Tensor.frame` is the index of the zero-copy frame that holds them (0 = the first frame after
the body).  (CudaIpcTensor's handles are a few dozen bytes: they stay in the header.)  A ZMQ message is

    request:  [identity (added by ROUTER), b"", Envelope, body, tensor frame 0, tensor frame 1, ...]
    reply:    [identity (consumed by ROUTER), b"", Envelope, body, tensor frames...]

where body is the msgpack of the method's request/response Struct (b"" when Envelope.error is set).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack integers stop at 2**64 - 1 by themselves
I64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# Never unbounded: a hostile header must not make the server allocate a huge list.
MAX_LIST = 4096


class _Msg(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


class Error(_Msg):
    code: U32 = 0  # drafter.v1.ErrorCode (= gRPC status code)
    field: str = ""
    message: str = ""


class Tensor(_Msg):
    dtype: str = ""
    shape: Annotated[list[I64], msgspec.Meta(max_length=8)] = []
    frame: U32 = 0  # proto: bytes data


class CudaIpcTensor(_Msg):
    """proto CudaIpcTensor: hidden states in the target's GPU memory (drafter.wire.cuda_ref checks it)."""

    dtype: str = ""
    shape: Annotated[list[I64], msgspec.Meta(max_length=8)] = []
    stride: Annotated[list[I64], msgspec.Meta(max_length=8)] = []
    storage_offset: U64 = 0
    device_uuid: str = ""
    handle: bytes = b""
    storage_size_bytes: U64 = 0
    storage_offset_bytes: U64 = 0
    ref_counter_handle: str = ""
    ref_counter_offset: U64 = 0
    event_handle: bytes = b""
    event_sync_required: bool = False
    step_event_handle: bytes = b""


class CudaIpcSupport(_Msg):
    enabled: bool = False
    host_id: str = ""
    device_uuids: Annotated[list[str], msgspec.Meta(max_length=64)] = []
    reason: str = ""


class KVGroup(_Msg):
    block_size: U32 = 0
    num_blocks: U32 = 0


class TreePath(_Msg):
    ranks: Annotated[list[U32], msgspec.Meta(max_length=64)] = []


Trees = Annotated[list[TreePath], msgspec.Meta(max_length=MAX_LIST)]
Groups = Annotated[list[KVGroup], msgspec.Meta(max_length=64)]
Sizes = Annotated[list[U32], msgspec.Meta(max_length=MAX_LIST)]


class AttachRequest(_Msg):
    protocol_version: U32 = 0
    method: str = ""
    num_speculative_tokens: U32 = 0
    speculative_token_tree: Trees = []
    hidden_dtype: str = ""
    hidden_size: U32 = 0
    num_aux_layers: U32 = 0
    max_model_len: U32 = 0
    max_num_seqs: U32 = 0
    max_num_batched_tokens: U32 = 0
    kv_groups: Groups = []
    client_name: str = ""
    cuda_ipc_capable: bool = False
    mtp_layer_schedule: str = ""


class Limits(_Msg):
    max_model_len: U32 = 0
    max_num_seqs: U32 = 0
    max_num_batched_tokens: U32 = 0
    max_message_bytes: U64 = 0
    vocab_size: U32 = 0
    hidden_width: U32 = 0
    kv_groups: Groups = []


class AttachResponse(_Msg):
    session_id: str = ""
    epoch: U64 = 0
    capture_sizes: Sizes = []
    token_capture_sizes: Sizes = []
    limits: Limits | None = None
    aux_layer_ids: Sizes = []
    num_speculative_tokens: U32 = 0
    speculative_token_tree: Trees = []
    protocol_version: U32 = 0
    cuda_ipc: CudaIpcSupport | None = None


Tensors = Annotated[list[Tensor], msgspec.Meta(max_length=64)]


class ProposeRequest(_Msg):
    session_id: str = ""
    epoch: U64 = 0
    request_id: U64 = 0
    target_token_ids: Tensor | None = None
    target_positions: Tensor | None = None
    target_hidden_states: Tensor | None = None
    next_token_ids: Tensor | None = None
    query_start_loc: Tensor | None = None
    seq_lens: Tensor | None = None
    block_tables: Tensors = []
    slot_mappings: Tensors = []
    token_indices_to_sample: Tensor | None = None
    num_rejected_tokens: Tensor | None = None
    temperatures: Tensor | None = None
    accepted_counts: Tensor | None = None
    return_probs: bool = False
    batch_padded: U32 = 0
    tokens_padded: U32 = 0
    target_hidden_states_ipc: CudaIpcTensor | None = None
    want_predrafts: bool = False


class ProposeResponse(_Msg):
    request_id: U64 = 0
    draft_token_ids: Tensor | None = None
    draft_probs: Tensor | None = None
    batch_padded: U32 = 0
    tokens_padded: U32 = 0
    error: Error | None = None


class PreDraftPush(_Msg):
    """proto PreDraftPush: pushed after a Propose's reply (ZMQ only; drafter.wire.predraft)."""

    request_id: U64 = 0
    session_id: str = ""
    epoch: U64 = 0
    block_ids: Tensor | None = None
    positions: Tensor | None = None
    conditioned_on: Tensor | None = None
    accepted: Tensor | None = None
    next_tokens: Tensor | None = None
    drafts: Tensor | None = None


class DetachRequest(_Msg):
    session_id: str = ""
    epoch: U64 = 0


class DetachResponse(_Msg):
    blocks_released: U32 = 0


class InfoRequest(_Msg):
    cuda_ipc_capable: bool = False


class InfoResponse(_Msg):
    protocol_version: U32 = 0
    epoch: U64 = 0
    state: str = ""
    method: str = ""
    num_speculative_tokens: U32 = 0
    speculative_token_tree: Trees = []
    dtype: str = ""
    hidden_size: U32 = 0
    num_aux_layers: U32 = 0
    aux_layer_ids: Sizes = []
    limits: Limits | None = None
    capture_sizes: Sizes = []
    token_capture_sizes: Sizes = []
    num_sessions: U32 = 0
    max_sessions: U32 = 0
    free_blocks: Sizes = []
    version: str = ""
    cuda_ipc: CudaIpcSupport | None = None
    mtp_layer_schedule: str = ""
    predraft_tokens: U32 = 0  # k' where pushed pre-drafts are deeper than k (a hit verifies k' drafts), else 0


# ---------------------------------------------------------------- ZMQ only
class Envelope(_Msg):
    """What gRPC keeps in HTTP/2 (method path, deadline, status); ZMQ carries it in its own frame."""

    call_id: U64 = 0  # chosen by the client, echoed in the reply (several calls may be in flight)
    method: str = ""  # Attach | Propose | Detach | Info; PreDrafts: pushed by the drafter (PreDraftPush)
    timeout_ms: U32 = 0  # 0 = no deadline
    error: Error | None = None  # replies only


# method -> (request Struct, response Struct); the gRPC service has the same methods (+ ProposeStream)
METHODS = {
    "Attach": (AttachRequest, AttachResponse),
    "Propose": (ProposeRequest, ProposeResponse),
    "Detach": (DetachRequest, DetachResponse),
    "Info": (InfoRequest, InfoResponse),
}
# proto message name -> Struct, for the schema-equality test and the generic proto conversion
MESSAGES = {cls.__name__: cls for cls in (
    Error, Tensor, CudaIpcTensor, CudaIpcSupport, KVGroup, TreePath, AttachRequest, AttachResponse, Limits,
    ProposeRequest, ProposeResponse, PreDraftPush,
    DetachRequest, DetachResponse, InfoRequest, InfoResponse)}


_RAW_MAP = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])


def utf8_field(buf, default: str) -> str:
    """The top-level field of a msgpack map whose value holds bytes that are not UTF-8 where a string
    belongs (msgspec's UnicodeDecodeError names no field); `default` when the map keys themselves are
    not UTF-8 or the buffer is not a map.  Runs only on a message already refused."""
    try:
        fields = _RAW_MAP.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
        return default
    for name, raw in fields.items():
        try:
            msgspec.msgpack.decode(raw)
        except UnicodeDecodeError:
            return name
        except msgspec.DecodeError:
            continue
    return default
