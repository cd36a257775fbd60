"""Opening sessions' CUDA IPC references on the drafter's GPU: once, checked, bounded, released.

Runs in the engine thread (CUDA work belongs there; the engine thread also frees what it opened,
since torch's release of a received storage synchronises a stream).  For each propose call whose
hidden states arrived as a reference (drafter.wire.cuda_ref, already checked field by field):

  1. the GPU the memory lives on must be one this drafter reads (its own, or a peer);
  2. the session's cache is asked for the storage (a target reuses one static buffer every
     step, so this is a dict hit after the first step); on a miss the handle is opened with
     torch's own consumer side of CUDA IPC, and the driver's mapping is checked to hold the
     whole tensor before anything reads it (the sizes in a reference are only claims, and a read
     past an allocation kills the CUDA context: every session's work with it);
  3. the drafter's stream waits for the client's step event (its writes of this step);
  4. the tensor is a view of the shared memory: no copy; the engine's graph loader reads it in place.

Each session keeps at most `per_session` storages (8) and 4 step events, least recently used out;
detach and expiry release them all (forget).  Releasing decrements the producer's torch ref counter,
after which the producer's allocator may reuse the memory.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from drafter.wire import schema
from drafter.wire import cuda_ref
from drafter.wire.cuda_ref import FIELD, CudaIpcRef
from drafter.wire.errors import invalid
from drafter.service.logs import session_tag

log = logging.getLogger("drafter.service.cuda_ipc")
PER_SESSION = 8
EVENTS_PER_SESSION = 4


class TorchCudaIpc:
    """The CUDA side, through torch's own CUDA IPC machinery (what torch.multiprocessing uses).

    torch, not raw cudart calls, because a torch producer expects torch's protocol: the consumer
    maps the allocation through the caching allocator's handle cache (one mapping per allocation,
    however many storages name it), waits on the producer's share-time event, and when it lets go
    decrements the producer's ref counter, which is what keeps the producer's allocator from
    reusing the memory while it is mapped here.  Raw cudaIpcOpenMemHandle would skip the counter.
    """

    def open_storage(self, ref: CudaIpcRef, device: torch.device) -> torch.UntypedStorage:
        # _new_shared_cuda: torch <= 2.1x; newer torch names it _new_shared_device (same 8 arguments)
        new_shared = getattr(torch.UntypedStorage, "_new_shared_cuda", None) or \
            torch.UntypedStorage._new_shared_device
        event = ref.event_handle if ref.event_sync_required else bytes(64)
        with torch.cuda.device(device):  # opened into THIS GPU's context (the producer's index means nothing here)
            return new_shared(device.index, ref.cuda_malloc_handle, ref.storage_size_bytes, ref.storage_offset_bytes,
                              ref.ref_counter_handle.encode(), ref.ref_counter_offset, event,
                              ref.event_sync_required)

    @staticmethod
    def mapped_bytes(storage: torch.UntypedStorage) -> int | None:
        """Bytes the driver maps from the storage's first byte to the end of its allocation (cuda_ref)."""
        return cuda_ref.mapped_bytes(storage)

    def open_event(self, handle: bytes, device: torch.device):
        return torch.cuda.Event.from_ipc_handle(device, handle)

    def wait(self, event, device: torch.device) -> None:
        torch.cuda.current_stream(device).wait_event(event)


class SessionRefs:
    """One session's open storages (Mapping, by CudaIpcRef.storage_key) and step events (by handle), LRU."""

    def __init__(self, per_session: int):
        self.per_session = per_session
        self.storages: OrderedDict = OrderedDict()
        self.events: OrderedDict = OrderedDict()

    def get(self, table: OrderedDict, key):
        value = table.get(key)
        if value is not None:
            table.move_to_end(key)
        return value

    def put(self, table: OrderedDict, key, value, capacity: int) -> None:
        while len(table) >= capacity:
            table.popitem(last=False)  # released here, in the engine thread
        table[key] = value


class Mapping:
    """An opened storage and the last view taken of it: a target sends the same static buffer,
    usually with the same geometry, step after step, and two torch calls fewer per step count
    on a GPU host (bench/results/2026-11-24-h100-host-probe).  The view holds the storage, so
    it goes when the mapping does."""

    def __init__(self, storage: torch.UntypedStorage):
        self.storage = storage
        self._geometry: tuple | None = None
        self._view: torch.Tensor | None = None

    def view_of(self, ref: CudaIpcRef) -> torch.Tensor:  # [num_tokens, hidden_width]
        geometry = (ref.dtype, ref.storage_offset, ref.shape, ref.stride)
        if geometry != self._geometry:
            self._geometry, self._view = geometry, view(self.storage, ref)
        return self._view


def view(storage: torch.UntypedStorage, ref: CudaIpcRef) -> torch.Tensor:
    """The reference's tensor [num_tokens, hidden_width] over `storage` (no copy)."""
    t = torch.empty(0, dtype=ref.dtype, device=storage.device)
    return t.set_(storage, ref.storage_offset, ref.shape, ref.stride)


class CudaIpcOpener:
    def __init__(self, device, support: schema.CudaIpcSupport, *, per_session: int = PER_SESSION,
                 backend=None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.readable = frozenset(support.device_uuids)
        self.per_session = per_session
        self.backend = backend or TorchCudaIpc()
        self.sessions: dict[str, SessionRefs] = {}
        self.opened = 0  # storages opened so far (each one a handle opened through torch)

    def tensor(self, session_id: str, ref: CudaIpcRef) -> torch.Tensor:
        """[num_tokens, hidden_width] on this drafter's device, ordered after the client's step writes."""
        if ref.device_uuid not in self.readable:
            raise invalid(f"{FIELD}.device_uuid", f"GPU {ref.device_uuid[:64]} is neither this drafter's nor a "
                                                  f"peer it can read")
        refs = self.sessions.setdefault(session_id, SessionRefs(self.per_session))
        mapping = refs.get(refs.storages, ref.storage_key)
        if mapping is None:
            mapping = Mapping(self._open(session_id, ref))
            refs.put(refs.storages, ref.storage_key, mapping, self.per_session)
        if ref.step_event_handle:
            self.backend.wait(self._event(refs, ref.step_event_handle), self.device)
        return mapping.view_of(ref)

    def forget(self, session_id: str) -> None:
        """Release everything the session opened (detach, expiry)."""
        self.sessions.pop(session_id, None)

    def _open(self, session_id: str, ref: CudaIpcRef) -> torch.UntypedStorage:
        try:
            storage = self.backend.open_storage(ref, self.device)
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/TypeError for handles it cannot open
            raise invalid(f"{FIELD}.handle", f"cannot open it on {self.device}: {type(exc).__name__}: "
                                             f"{str(exc)[:300]}") from None
        problem = self._mapping_problem(storage, ref)
        if problem is not None:
            del storage  # released here, not wherever the exception's frames are collected
            raise problem
        self.opened += 1
        log.info("cuda ipc reference opened", extra={"event": "cuda_ipc_open", "session": session_tag(session_id),
                                                     "bytes": ref.storage_size_bytes, "gpu": ref.device_uuid})
        return storage

    def _mapping_problem(self, storage: torch.UntypedStorage, ref: CudaIpcRef):
        need = ref.bytes_needed
        if storage.nbytes() < need:
            return invalid(f"{FIELD}.storage_size_bytes", f"the storage holds {storage.nbytes()} bytes, the "
                                                          f"tensor needs {need}")
        mapped = self.backend.mapped_bytes(storage)
        if mapped is None:
            return invalid(f"{FIELD}.handle", "the CUDA driver cannot tell the extent of the shared allocation")
        if mapped < need:
            return invalid(f"{FIELD}.storage_size_bytes", f"the shared allocation holds {mapped} bytes from the "
                                                          f"storage's start, the tensor needs {need}")
        return None

    def _event(self, refs: SessionRefs, handle: bytes):
        event = refs.get(refs.events, handle)
        if event is None:
            try:
                event = self.backend.open_event(handle, self.device)
            except Exception as exc:  # noqa: BLE001
                raise invalid(f"{FIELD}.step_event_handle", f"cannot open the event: {type(exc).__name__}: "
                                                            f"{str(exc)[:300]}") from None
            refs.put(refs.events, handle, event, EVENTS_PER_SESSION)
        return event
