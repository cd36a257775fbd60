"""CUDA IPC references for CPU tests: well-formed wire messages, and a fake CUDA side for the opener.

Nothing here opens a handle: the fake backend hands out CPU storages, so the opener's cache,
checks and release order can be tested where no GPU exists (tests/gpu/test_cuda_ipc.py runs the
real thing).
"""

from __future__ import annotations

import weakref

import torch

from drafter.wire import schema
from drafter.wire.cuda_ref import HIDDEN_DTYPE_NAMES, decode_ref

UUID = "GPU-00000000-1111-2222-3333-444444444444"


def ref_message(rows: int, width: int, dtype: torch.dtype = torch.float32, *, seed: int = 0, row_stride=None,
                storage_offset: int = 0, **fields) -> schema.CudaIpcTensor:
    """A well-formed CudaIpcTensor for a [rows, width] tensor; `fields` override any field."""
    stride = row_stride or width
    size = (storage_offset + max(rows - 1, 0) * stride + width) * dtype.itemsize
    base = dict(dtype=HIDDEN_DTYPE_NAMES[dtype], shape=[rows, width], stride=[stride, 1],
                storage_offset=storage_offset, device_uuid=UUID, handle=bytes([2, ord("c")]) + _bytes(64, seed),
                storage_size_bytes=size, storage_offset_bytes=0, ref_counter_handle=f"/torch_4242_{seed}_7",
                ref_counter_offset=seed % 100, event_handle=_bytes(64, seed + 1), event_sync_required=True,
                step_event_handle=_bytes(64, seed + 2))
    base.update(fields)
    return schema.CudaIpcTensor(**base)


def ref(rows: int, width: int, dtype: torch.dtype = torch.float32, **kw):
    return decode_ref(ref_message(rows, width, dtype, **kw))


def _bytes(n: int, seed: int) -> bytes:
    return bytes((seed * 31 + i * 7) % 256 for i in range(n))


class FakeCudaIpc:
    """The opener's backend on the CPU: each opened 'handle' is a CPU storage holding `content`.

    content: {storage_key or None (default): float tensor copied into the storage}; mapped: bytes the
    fake driver reports (None = as large as the storage); fail_open / fail_event: raise instead."""

    def __init__(self, content: torch.Tensor | None = None, mapped=-1):
        self.content = content
        self.mapped = mapped
        self.fail_open = False
        self.fail_event = False
        self.opens: list = []
        self.event_opens: list = []
        self.waits: list = []
        self.alive: dict = {}  # storage_key -> weakref (dead once the opener dropped it)

    def open_storage(self, ref, device):
        if self.fail_open:
            raise RuntimeError("CUDA error: invalid argument (fake)")
        self.opens.append(ref.storage_key)
        storage = torch.UntypedStorage(ref.storage_size_bytes)
        if self.content is not None:  # the producer's bytes, from the storage's start
            flat = self.content.reshape(-1).view(torch.uint8)[:storage.nbytes()]
            torch.empty(0, dtype=torch.uint8).set_(storage)[:flat.numel()].copy_(flat)
        self.alive[ref.storage_key] = weakref.ref(storage)
        return storage

    def mapped_bytes(self, storage):
        return storage.nbytes() if self.mapped == -1 else self.mapped

    def open_event(self, handle, device):
        if self.fail_event:
            raise RuntimeError("invalid resource handle (fake)")
        self.event_opens.append(handle)
        return ("event", handle)

    def wait(self, event, device):
        self.waits.append(event)

    def released(self, key) -> bool:
        return self.alive[key]() is None
