"""A CUDA IPC reference to a target's hidden states (proto CudaIpcTensor), checked without a GPU.

Both sides use it: the server decodes and checks every field here, in the transport, before
anything opens a handle (drafter.service.cuda_ipc opens it later, in the engine thread); the
client builds one from torch's share tuple (coordinator.transport.cuda_share).  Every check names
the offending field as `target_hidden_states_ipc.<field>`.

What is accepted, and why:
  * dtype a float type, shape [rows, width], stride [row stride >= width, 1]: the engine's graph
    loader reads rows of unit column stride in place (anything else it would copy);
  * storage_size_bytes covering storage_offset + the tensor's extent (checked again against the
    driver's mapping after opening: a size is only a claim);
  * handle: torch's cudaMalloc-kind handle only, legacy (64 bytes) or versioned (version byte, 'c',
    64 bytes), opened as the bare 64 bytes (readable by every torch version).  Expandable segments'
    handles ('e') carry process ids and file descriptors that the opener would fetch from another
    process: a peer must not steer that;
  * ref_counter_handle: torch's own file name pattern, ref_counter_offset inside torch's counter
    file: on release the drafter decrements the int64 at that offset of that file, so both are
    bounded to what torch itself produces;
  * event handles: 64 bytes (cudaIpcEventHandle_t), or empty where none is sent.
"""

from __future__ import annotations

import ctypes
import functools

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from drafter.wire.errors import invalid

FIELD = "target_hidden_states_ipc"
HIDDEN_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HIDDEN_DTYPE_NAMES = {v: k for k, v in HIDDEN_DTYPES.items()}
IPC_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE: cudaIpcMemHandle_t and cudaIpcEventHandle_t
CUDA_MALLOC_KIND = ord("c")  # torch's ShareableHandleType SHAREABLE_CUDA_MALLOC
MAX_HANDLE_VERSION = 8  # torch 2.11 writes 2, 2.13 writes 3: the same 'c' + 64 bytes
REF_COUNTER_SLOTS = 10000  # torch::CUDA_IPC_REF_COUNTER_FILE_SIZE: int64 counters per file
REF_COUNTER_NAME = re.compile(r"/torch_\d{1,10}_\d{1,20}_\d{1,20}")  # at::NewProcessWideShmHandle()
MAX_DIM = 2**31 - 1
MAX_STORAGE_BYTES = 2**48
# fields whose refusal says "this host cannot share with this drafter", not "this request is wrong":
# a client then stops sharing and sends bytes (coordinator.transport.cuda_share)
ENVIRONMENT_FIELDS = (f"{FIELD}.handle", f"{FIELD}.device_uuid", f"{FIELD}.step_event_handle")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_id() -> str:
    """This host's boot id ("" where the kernel does not say)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def device_uuid(device) -> str:
    """The GPU's uuid as torch reports it (the same string in every process, whatever its device index)."""
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


@dataclass(frozen=True)
class CudaIpcRef:
    dtype: torch.dtype
    shape: tuple[int, int]  # [num_tokens, hidden_width]
    stride: tuple[int, int]  # in elements
    storage_offset: int  # in elements
    device_uuid: str
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    step_event_handle: bytes

    @property
    def storage_key(self) -> tuple:
        """One shared storage (torch's own cache key, plus the counter that share created)."""
        return (self.handle, self.storage_offset_bytes, self.storage_size_bytes, self.ref_counter_handle,
                self.ref_counter_offset)

    @property
    def cuda_malloc_handle(self) -> bytes:
        """The bare cudaIpcMemHandle_t: every torch reads a 64-byte handle as one (its versioned form only
        adds a version byte, which torch 2.13 bumped to 3 and torch 2.11 refuses, and the kind 'c'), so the
        drafter opens what a target of another torch version shares."""
        return self.handle[-IPC_HANDLE_BYTES:]

    @property
    def bytes_needed(self) -> int:
        """Bytes of the storage the tensor reaches, from the storage's start."""
        return extent_bytes(self.shape, self.stride, self.storage_offset, self.dtype.itemsize)

    def to_wire(self, cls):
        """The message `cls` (schema.CudaIpcTensor or the protobuf CudaIpcTensor) holding this reference."""
        return cls(dtype=HIDDEN_DTYPE_NAMES[self.dtype], shape=list(self.shape), stride=list(self.stride),
                   storage_offset=self.storage_offset, device_uuid=self.device_uuid, handle=self.handle,
                   storage_size_bytes=self.storage_size_bytes, storage_offset_bytes=self.storage_offset_bytes,
                   ref_counter_handle=self.ref_counter_handle, ref_counter_offset=self.ref_counter_offset,
                   event_handle=self.event_handle, event_sync_required=self.event_sync_required,
                   step_event_handle=self.step_event_handle)


def extent_bytes(shape, stride, storage_offset: int, itemsize: int) -> int:
    if math.prod(shape) == 0:
        return 0
    last = storage_offset + sum((n - 1) * s for n, s in zip(shape, stride))
    return (last + 1) * itemsize


def _bad(name: str, message: str):
    return invalid(f"{FIELD}.{name}" if name else FIELD, message)


def _layout(m) -> tuple[torch.dtype, tuple, tuple]:
    dtype = HIDDEN_DTYPES.get(m.dtype)
    if dtype is None:
        raise _bad("dtype", f"dtype {m.dtype!r} not allowed; expected one of {sorted(HIDDEN_DTYPES)}")
    shape, stride = tuple(m.shape), tuple(m.stride)
    if len(shape) != 2:
        raise _bad("shape", f"expected [num_tokens, hidden_width], got shape {list(shape)}")
    if min(shape) < 0 or max(shape) > MAX_DIM:
        raise _bad("shape", f"sizes must lie in [0, {MAX_DIM}], got shape {list(shape)}")
    if len(stride) != 2 or stride[1] != 1 or not shape[1] <= stride[0] <= MAX_DIM:
        raise _bad("stride", f"expected [row stride in [{shape[1]}, {MAX_DIM}], 1], got {list(stride)}")
    return dtype, shape, stride


def _storage(m, dtype, shape, stride) -> None:
    if m.storage_offset > MAX_DIM:
        raise _bad("storage_offset", f"{m.storage_offset} exceeds {MAX_DIM}")
    if m.storage_size_bytes > MAX_STORAGE_BYTES or m.storage_offset_bytes > MAX_STORAGE_BYTES:
        raise _bad("storage_size_bytes", f"storage of {m.storage_size_bytes} bytes at offset "
                                         f"{m.storage_offset_bytes}: beyond any GPU's memory")
    need = extent_bytes(shape, stride, m.storage_offset, dtype.itemsize)
    if m.storage_size_bytes < need:
        raise _bad("storage_size_bytes", f"{m.storage_size_bytes} bytes; shape {list(shape)}, stride "
                                         f"{list(stride)} at offset {m.storage_offset} need {need}")


def _handles(m) -> None:
    h = bytes(m.handle)
    legacy = len(h) == IPC_HANDLE_BYTES
    versioned = len(h) == IPC_HANDLE_BYTES + 2 and 1 <= h[0] <= MAX_HANDLE_VERSION and h[1] == CUDA_MALLOC_KIND
    if not (legacy or versioned):
        kind = "an expandable-segments handle (allocate the buffer with expandable_segments off)" \
            if len(h) > 1 and h[1] == ord("e") else f"{len(h)} bytes"
        raise _bad("handle", f"not a cudaMalloc IPC handle of torch's caching allocator: {kind}")
    if not REF_COUNTER_NAME.fullmatch(m.ref_counter_handle):
        raise _bad("ref_counter_handle", f"{m.ref_counter_handle[:80]!r} is not a torch ref-counter file name")
    if m.ref_counter_offset >= REF_COUNTER_SLOTS:
        raise _bad("ref_counter_offset", f"{m.ref_counter_offset} outside torch's {REF_COUNTER_SLOTS} counters")
    if len(m.event_handle) != IPC_HANDLE_BYTES and (m.event_sync_required or len(m.event_handle)):
        raise _bad("event_handle", f"{len(m.event_handle)} bytes; an IPC event handle has {IPC_HANDLE_BYTES}")
    if len(m.step_event_handle) not in (0, IPC_HANDLE_BYTES):
        raise _bad("step_event_handle", f"{len(m.step_event_handle)} bytes; expected {IPC_HANDLE_BYTES} or none")


def decode_ref(m) -> CudaIpcRef:
    """schema.CudaIpcTensor or protobuf CudaIpcTensor -> CudaIpcRef; DrafterError naming the field."""
    dtype, shape, stride = _layout(m)
    _storage(m, dtype, shape, stride)
    _handles(m)
    if not 0 < len(m.device_uuid) <= 64 or not m.device_uuid.isprintable():
        raise _bad("device_uuid", "must name the GPU holding the memory")
    return CudaIpcRef(dtype, shape, stride, m.storage_offset, m.device_uuid, bytes(m.handle), m.storage_size_bytes,
                      m.storage_offset_bytes, m.ref_counter_handle, m.ref_counter_offset, bytes(m.event_handle),
                      bool(m.event_sync_required), bytes(m.step_event_handle))


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.c_uint64]
    return lib


def mapped_bytes(storage) -> int | None:
    """Bytes the driver maps from a CUDA storage's first byte to the end of its allocation; None if
    the driver cannot tell.  (cuMemGetAddressRange: torch has no API for an allocation's extent.)"""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if _driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), storage.data_ptr()) != 0:
        return None
    return base.value + size.value - storage.data_ptr()
