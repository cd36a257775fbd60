"""Bound sessions on the wire: the target's persistent buffers described once, then a step header.

    control socket:  Bind(session, buffers, plane, transport) -> BindResponse(data endpoint, ring bytes)
    data socket:     [StepHeader, ring prefix]  ->  [StepDone, drafts]      (once per decoding step)

A target that keeps its per-step inputs in persistent buffers describes them once (name, dtype,
capacity): both ends then lay them out identically in one contiguous slab, the ring
(ring_layout).  The target's buffers ARE views into its slab, so a step ships the slab's used
prefix as one frame, and the drafter receives that frame straight into its own ring, whose views
its engine was bound to once (drafter.engine.bound).  The hidden states lie last in the slab: the prefix
holds every small buffer whole and the first num_tokens rows of the hidden states, nothing else
the step does not need.

Three planes carry the ring's bytes, the same protocol above them: "host_ring" sends them as the
step's second ZMQ frame, or where the Bind asked for it (BindRequest.stream) on the binding's ring
stream (BindResponse.stream, drafter.wire.ring_stream: header and prefix on one plain tcp or
same-host UNIX connection, the prefix in chunks straight into the pinned ring); "gloo_channel" sends them by a point-to-point send on a two-rank
torch.distributed process group (gloo) that the two sides build from a TCPStore the drafter
hosts (BindResponse.store) under a key prefix of this binding (BindResponse.channel): the target
is rank 0, the drafter rank 1; the step header and the reply still go over the data socket.
"nccl_channel" is that channel with NCCL on two GPUs (another GPU of the host, or another host):
the target's GPU slab prefix goes by one send into the drafter's GPU slab, the drafter checks and
masks it on its GPU (the step guard, as on cuda_ipc) and sends its whole output (drafts, then the
error word: output_words) back by one send into the target's output; StepDone on the data socket
says the output was sent (code 0) or that it was not (a refusal).  Both sides first exchange one
word (the handshake: NCCL builds the communicator at the first operation, which both must join).
NCCL refuses two ranks on one GPU: BindRequest.device_uuid names the target's, and the drafter
refuses a binding whose GPU is its own (FAILED_PRECONDITION "device_uuid").
"cuda_ipc" (same host, both sides on CUDA) carries no bytes at all: at Bind the target shares its
slab, a CUDA allocation, once (BindRequest.slab, a CUDA IPC reference to it viewed as
[ring_bytes / 64, 16] float32, with the handle of its "inputs ready" interprocess event) and the
drafter shares back its output (BindResponse.output: the drafts, then one int64 error word) with
its "drafts ready" event (BindResponse.drafts_event).  A step is the header alone; the drafter's
stream waits on the target's event, the drafter checks and masks the step on the GPU
(drafter.engine.step_guard: the error word is a bitmask over guard_fields), replays, records its
event and replies StepDone at once; the target's stream waits on that event and reads the drafts
and the error word back together.
A cuda_ipc or nccl_channel Bind may ask for a doorbell (BindRequest.doorbell): the drafter then
answers with the address of a same-host UNIX-domain connection (BindResponse.doorbell,
drafter.wire.doorbell) that carries the same StepHeader and StepDone records as the data socket,
one kernel wake-up a way (a target on another host cannot reach it and keeps the data socket).
Both records omit fields at their defaults, so a peer that does not know the field never sees it
(a drafter that does not know it refuses a Bind that asks: the target binds again without).
Every step names its binding (StepHeader.bind_id, the random id the Bind's reply gave): the
drafter refuses a step for another binding (FAILED_PRECONDITION "bind_id": bind again), so a
binding never runs a step meant for an earlier one.  A step may carry the rows' accepted counts of
the previous step, which the drafter's acceptance metrics count as for an unbound Propose.
These records are ZMQ-only (msgspec): the proto schema
has no Bind message, and gRPC clients keep the unbound Propose.  Neutral: imports neither the
engine nor the service.
"""

from __future__ import annotations

import msgspec

from drafter.wire.schema import CudaIpcTensor

BIND_METHOD = "Bind"
HOST_RING = "host_ring"
GLOO_CHANNEL = "gloo_channel"
NCCL_CHANNEL = "nccl_channel"
CUDA_IPC = "cuda_ipc"
PLANES = (HOST_RING, GLOO_CHANNEL, CUDA_IPC, NCCL_CHANNEL)
CHANNELS = (GLOO_CHANNEL, NCCL_CHANNEL)  # the planes on a two-rank process group from the drafter's TCPStore
TRANSPORTS = ("tcp", "ipc")
HIDDEN = "target_hidden_states"
STAGINGS = ("span", "step")  # BindRequest.stream_staging
ALIGN = 64  # bytes: every buffer of the ring starts on a cache line
MAX_BUFFERS = 64

# the buffers a bound session may register, per KV group where named with [g]
INT_BUFFERS = ("target_token_ids", "target_positions", "next_token_ids", "query_start_loc", "seq_lens",
               "token_indices_to_sample", "num_rejected_tokens")
REQUIRED = ("target_token_ids", "target_positions", HIDDEN, "next_token_ids", "query_start_loc", "seq_lens")


class BufferSpec(msgspec.Struct, forbid_unknown_fields=True):
    """One persistent buffer: its field name ("block_tables[0]"), wire dtype and full shape."""

    name: str
    dtype: str
    shape: list[int]


class BindRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    session_id: str = ""
    epoch: int = 0
    plane: str = HOST_RING
    transport: str = "tcp"  # the data socket: "tcp" (on the control socket's host) or "ipc" (same host)
    buffers: list[BufferSpec] = []
    max_batch: int = 0  # rows of the drafts output (the drafter keeps it; its rows come back in StepDone's frame)
    slab: CudaIpcTensor | None = None  # cuda_ipc: the target's slab ([ring_bytes / 64, 16] float32) and its
    # "inputs ready" event (step_event_handle)
    device_uuid: str = ""  # nccl_channel: the target's GPU (NCCL refuses two ranks on one GPU)
    doorbell: bool = False  # cuda_ipc, nccl_channel: steps by a same-host doorbell (BindResponse.doorbell) where
    # one can be made
    spin_us: int = 0  # with the doorbell: after each reply the drafter polls it this long for the next header
    # before its thread sleeps (at most MAX_SPIN_US; a core busy meanwhile): for steps that come back to back
    stream: bool = False  # host_ring: steps by the binding's ring stream (BindResponse.stream, drafter.wire.
    # ring_stream: the prefix in chunks on a plain connection, straight into the pinned ring) where one can be made
    stream_lanes: int = 0  # with stream: the connections the target makes to it and stripes each prefix over
    # (0 or 1: one; more than ring_stream.MAX_LANES is refused naming stream_lanes)
    stream_staging: str = "span"  # a GPU drafter's host-to-device copy of a streamed prefix: "span" (each span
    # as it lands) or "step" (the whole prefix in one copy at the step); anything else is refused naming it
    armed: bool = False  # cuda_ipc: the target starts each step from its GPU (see ARM_WORDS): after its inputs, on
    # its stream, it copies the step's record and then the go word into the arm row of the drafter's output


class BindResponse(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    bind_id: str = ""
    endpoint: str = ""  # the session's data socket
    ring_bytes: int = 0
    drafts_width: int = 0
    store: str = ""  # gloo_channel, nccl_channel: the drafter's TCPStore, "host:port"
    channel: str = ""  # gloo_channel, nccl_channel: the store key prefix of this binding's process group
    output: CudaIpcTensor | None = None  # cuda_ipc: the drafter's output ([max_batch * width + 1] int64 at the
    # start of [rows, 16] float32): the drafts row-major, then the step's error word
    drafts_event: bytes = b""  # cuda_ipc: the drafter's "drafts ready" interprocess event
    doorbell: str = ""  # where BindRequest.doorbell asked and the drafter has one: its address
    # (drafter.wire.doorbell), which takes the binding's steps as the data socket does
    stream: str = ""  # where BindRequest.stream asked: the ring stream's address (drafter.wire.ring_stream),
    # which takes the binding's steps, header and prefix, as the data socket does
    armed: bool = False  # where BindRequest.armed asked and the drafter can: its output ends with the arm row
    # (ARM_WORDS) and its steps record drafts_event (even steps) or drafts_event_odd (odd steps)
    drafts_event_odd: bytes = b""


class StepHeader(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One decoding step: its sizes, the ring prefix's length (what follows in the next frame),
    the binding it is for, and optionally how many drafts of each row's previous step the target
    accepted."""

    step: int
    num_tokens: int
    batch: int
    batch_padded: int = 0  # 0: the drafter picks
    tokens_padded: int = 0
    nbytes: int = 0
    bind_id: str = ""  # BindResponse.bind_id: a step for any other binding is refused (FAILED_PRECONDITION)
    accepted_counts: list[int] = []  # [batch] or empty; -1: no report for that row (the acceptance metrics)
    # after the StepDone, push this step's pre-drafts on the same channel (drafter.wire.predraft.BOUND_PUSH;
    # a drafter serving --predraft-outcomes, cuda_ipc: drafter.service.predraft.BoundPreDrafts)
    want_predrafts: bool = False
    # the target's rule for verifying pre-drafts (drafter.wire.predraft.verifies_predrafts): also when at
    # least this share of the rows hit (0: only when every row hits); both ends apply it to the same picks
    predraft_min_hits: float = 0.0


class StepDone(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The step's reply: code 0 and the drafts in the next frame, or an error naming the field."""

    step: int
    code: int = 0
    field: str = ""
    message: str = ""
    # the drafter's time.perf_counter_ns() (CLOCK_MONOTONIC: comparable with the target's on one
    # host) at STAMPS' points; empty where the plane does not stamp (the host ring, the gloo channel)
    stamps: list[int] = []


class Slot(msgspec.Struct, frozen=True):
    """Where one buffer lies in the ring."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    row_bytes: int  # bytes of one leading-dimension row


def ring_layout(buffers: list[BufferSpec], itemsize) -> tuple[list[Slot], int]:
    """Both ends' identical layout of the buffers in one slab: the given order, the hidden states
    last, each aligned to ALIGN bytes; (slots, total bytes).  itemsize(dtype name) -> bytes."""
    order = [b for b in buffers if b.name != HIDDEN] + [b for b in buffers if b.name == HIDDEN]
    slots, offset = [], 0
    for b in order:
        row = itemsize(b.dtype)
        for d in b.shape[1:]:
            row *= d
        nbytes = row * (b.shape[0] if b.shape else 0)
        slots.append(Slot(b.name, b.dtype, tuple(b.shape), offset, nbytes, row))
        offset += -(-nbytes // ALIGN) * ALIGN
    return slots, offset


def step_bytes(slots: list[Slot], num_tokens: int) -> int:
    """Bytes of the ring a step of num_tokens tokens ships: every small buffer whole, then the
    hidden states' first num_tokens rows."""
    hidden = next(s for s in slots if s.name == HIDDEN)
    return hidden.offset + num_tokens * hidden.row_bytes


def output_words(max_batch: int, width: int) -> int:
    """int64 words of a drafter's output on the cuda_ipc and nccl_channel planes: max_batch rows of
    width drafts, then one error word, rounded up to whole 64-byte rows (both ends allocate it so)."""
    return -(-(max_batch * width + 1) // 8) * 8


# An armed binding (BindRequest.armed) starts a step on the drafter's GPU without its host: the drafter queues
# each next step ahead of its header behind a GPU wait on the go word, and the target, after writing its
# inputs, copies on its own stream the step's record and then the go word into the arm row, one 64-byte row
# after the output's words (output_words): int64 words ARM_STEP.. of the record (the step and its four sizes
# as the header gives them), then word ARM_GO: two 32-bit go words, both the step (compared cyclically), in one
# 8-byte copy.  The drafter waits on one of the two; to release a step queued ahead whose header has not come
# (another user takes the engine) it writes that word itself and waits on the other from then on, so a step
# it released is never taken for started when its header comes.  The drafter's queued step runs only where
# the record equals the step and sizes it was queued for; otherwise it reads and writes nothing, and the step
# runs once its header has come.
ARM_WORDS = 8
ARM_GO, ARM_STEP = 0, 1  # word indices in the arm row; the record is words ARM_STEP .. ARM_STEP + 4
ARM_RECORD = 5  # int64 words of the record: step, num_tokens, batch, batch_padded, tokens_padded


def arm_words(max_batch: int, width: int, armed: bool) -> int:
    """int64 words of a cuda_ipc drafter's shared output: output_words, and the arm row where armed."""
    return output_words(max_batch, width) + (ARM_WORDS if armed else 0)


MAX_SPIN_US = 5000  # the most BindRequest.spin_us a drafter grants (a larger ask is refused naming spin_us)
SLAB_ROW = 16  # a shared slab or output travels as [bytes / 64, 16] float32 (one cache line a row)


def guard_fields(groups: int) -> tuple[str, ...]:
    """The fields a cuda_ipc step is checked for on the GPU, in bit order of the error word
    (bit i set: guard_fields(groups)[i] was out of range for the session)."""
    per_group = tuple(f"block_tables[{g}]" for g in range(groups)) + tuple(
        f"slot_mappings[{g}]" for g in range(groups))
    return ("target_token_ids", "target_positions", HIDDEN, "next_token_ids", "query_start_loc", "seq_lens",
            *per_group, "token_indices_to_sample", "num_rejected_tokens")


def first_bad_guard_field(word: int, groups: int) -> str | None:
    """The first field an error word names (its lowest set bit); None for 0."""
    if not word:
        return None
    fields = guard_fields(groups)
    bit = (word & -word).bit_length() - 1
    return fields[bit] if bit < len(fields) else f"error word {word:#x}"


_ENC = msgspec.msgpack.Encoder()
STEP_DECODER = msgspec.msgpack.Decoder(StepHeader)
DONE_DECODER = msgspec.msgpack.Decoder(StepDone)
STAMPS = ("received", "started", "queued", "replied")  # header read; step began (lock held); GPU work queued; reply encoded
# after STAMPS in StepDone.stamps where the plane takes them (cuda_ipc): between "started" and
# "queued", the stream's wait for the target's event queued, "guarded" (equal to "waited" since the
# guard is folded into the bound replay; a drafter before the fold stamped its own replay there), the
# bound replay queued, the guard's launches first (the done event's record follows)
FINE_STAMPS = ("waited", "guarded", "replayed")
# after STAMPS in a host_ring step's StepDone.stamps: the prefix whole in the drafter's pinned ring
# (on the ring stream its last chunk read, "received" being its header's; on the data socket the
# message received, as "received")
RING_STAMPS = ("landed",)
BIND_DECODER = msgspec.msgpack.Decoder(BindRequest)
BIND_RESPONSE_DECODER = msgspec.msgpack.Decoder(BindResponse)


def encode(record) -> bytes:
    return _ENC.encode(record)
