"""One CUDA allocation shared once between the target and the drafter (the cuda_ipc plane).

Both ends use it: the target shares its slab and the drafter opens it; the drafter shares its
output and the target opens that.  A shared buffer travels as a schema.CudaIpcTensor of
[bytes / 64, 16] float32 (drafter.wire.cuda_ref checks every field of it, as for hidden states)
and is opened as the uint8 bytes it holds, checked against the driver's mapping before anything
reads it.  Events: one interprocess CUDA event per direction, created once, recorded per step.

Torch's own CUDA IPC (UntypedStorage._share_cuda_ and its consumer), as in
coordinator.transport.cuda_share and drafter.service.cuda_ipc: the producer's ref counter keeps
its allocator from reusing the memory while the other side holds it.

`LocalSlabs` does the same within one process, without CUDA (a handle names a registered tensor,
events are no-ops): the CPU tests run the whole plane over it.
"""

from __future__ import annotations

import secrets

import torch

from drafter.wire import cuda_ref, schema, stream_ops
from drafter.wire.errors import invalid

ROW = 16  # float32 a row: one 64-byte cache line


def as_rows(t: torch.Tensor) -> torch.Tensor:  # t: [bytes] uint8 (bytes a multiple of 64) -> [bytes / 64, 16] f32
    return t.view(torch.float32).view(-1, ROW)


def check_ref(m: schema.CudaIpcTensor | None, field: str, nbytes: int) -> cuda_ref.CudaIpcRef:
    """A shared buffer's reference, every field checked (DrafterError naming `field`.<name>), and
    that it describes exactly [nbytes / 64, 16] float32, contiguous."""
    if m is None:
        raise invalid(field, "the cuda_ipc plane needs a reference to the shared buffer")
    try:
        ref = cuda_ref.decode_ref(m)
    except Exception as exc:  # DrafterError naming target_hidden_states_ipc.<name>: renamed to this field
        name = getattr(exc, "field", "").split(".", 1)
        raise invalid(f"{field}.{name[1]}" if len(name) == 2 else field, getattr(exc, "message", str(exc))) from None
    if ref.dtype != torch.float32 or ref.shape != (nbytes // 64, ROW) or ref.stride != (ROW, 1):
        raise invalid(f"{field}.shape", f"expected [{nbytes // 64}, {ROW}] float32 contiguous, got "
                                        f"{list(ref.shape)} {ref.dtype} stride {list(ref.stride)}")
    return ref


class TorchSlabs:
    """The CUDA side, through torch's CUDA IPC."""

    def __init__(self):
        self._held: list = []  # storages shared out: kept while the binding lives

    # ---- producer
    def share(self, t: torch.Tensor, event_handle: bytes) -> schema.CudaIpcTensor:
        """t: [bytes] uint8 on a GPU, 64-byte aligned -> its reference (with `event_handle`)."""
        rows = as_rows(t)
        storage = rows.untyped_storage()
        share = (getattr(storage, "_share_cuda_", None) or storage._share_device_)()
        self._held.append(storage)
        return schema.CudaIpcTensor(
            dtype="float32", shape=list(rows.shape), stride=list(rows.stride()), storage_offset=rows.storage_offset(),
            device_uuid=cuda_ref.device_uuid(t.device), handle=bytes(share[1]), storage_size_bytes=int(share[2]),
            storage_offset_bytes=int(share[3]), ref_counter_handle=bytes(share[4]).decode(),
            ref_counter_offset=int(share[5]), event_handle=bytes(share[6]), event_sync_required=bool(share[7]),
            step_event_handle=event_handle)

    def new_event(self, device: torch.device):
        """An interprocess event recorded once (so it exists on the device); (event, handle)."""
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(device))
        return event, bytes(event.ipc_handle())

    # ---- consumer
    def open(self, ref: cuda_ref.CudaIpcRef, device: torch.device, field: str) -> torch.Tensor:
        """The shared buffer as [bytes] uint8 on `device` (no copy); refused naming `field`."""
        new_shared = getattr(torch.UntypedStorage, "_new_shared_cuda", None) or \
            torch.UntypedStorage._new_shared_device
        event = ref.event_handle if ref.event_sync_required else bytes(64)
        try:
            with torch.cuda.device(device):
                storage = new_shared(device.index, ref.cuda_malloc_handle, ref.storage_size_bytes,
                                     ref.storage_offset_bytes, ref.ref_counter_handle.encode(), ref.ref_counter_offset,
                                     event, ref.event_sync_required)
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/TypeError for handles it cannot open
            raise invalid(f"{field}.handle", f"cannot open it on {device}: {type(exc).__name__}: "
                                             f"{str(exc)[:300]}") from None
        need = ref.bytes_needed
        mapped = cuda_ref.mapped_bytes(storage)
        if storage.nbytes() < need or mapped is None or mapped < need:
            raise invalid(f"{field}.storage_size_bytes", f"the shared allocation does not hold the {need} bytes "
                                                         "the reference claims")
        start = ref.storage_offset * 4
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (need - start,), (1,))

    def open_event(self, handle: bytes, device: torch.device, field: str):
        try:
            return torch.cuda.Event.from_ipc_handle(device, handle)
        except Exception as exc:  # noqa: BLE001
            raise invalid(f"{field}.step_event_handle", f"cannot open the event: {type(exc).__name__}: "
                                                        f"{str(exc)[:300]}") from None

    # ---- per step
    @staticmethod
    def record(event, device: torch.device) -> None:
        event.record(torch.cuda.current_stream(device))

    @staticmethod
    def wait(event, device: torch.device) -> None:
        torch.cuda.current_stream(device).wait_event(event)

    @staticmethod
    def synchronize(event) -> None:
        """The host waits for the event (another process's work included)."""
        event.synchronize()

    # ---- armed steps (drafter.wire.stream_ops): words one GPU waits for and another writes
    @staticmethod
    def can_arm() -> bool:
        return stream_ops.available()

    @staticmethod
    def copy_words(dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> None:
        """Queue on the current stream the copy of pinned `src` into `dst` (device memory, possibly
        another process's), read when the copy runs."""
        if torch.cuda.current_device() != device.index:  # the driver call needs the stream's context current
            with torch.cuda.device(device):
                TorchSlabs.copy_words(dst, src, device)
            return
        stream_ops.copy_to_device(torch.cuda.current_stream(device).cuda_stream, dst.data_ptr(), src.data_ptr(),
                                  src.numel() * src.element_size())

    @staticmethod
    def wait_word(word: torch.Tensor, value: int, device: torch.device) -> None:
        """Queue on the current stream a wait until the int32 `word` (this GPU's memory) reaches `value`."""
        stream_ops.wait_geq(torch.cuda.current_stream(device).cuda_stream, word.data_ptr(), value)

    @staticmethod
    def release_word(word: torch.Tensor, value: int, device: torch.device) -> None:
        """Write `value` into the int32 `word` from a stream of its own (the current one may be
        blocked on that very word), now."""
        with torch.cuda.device(device):  # any thread (a drain runs on whoever takes the engine's lock)
            side = torch.cuda.Stream(device)
            stream_ops.write(side.cuda_stream, word.data_ptr(), value)


class LocalSlabs:
    """The same protocol inside one process on any device: a handle names a tensor registered by
    share(); events order nothing (CPU work is synchronous).  For the CPU tests of the plane."""

    REGISTRY: dict[bytes, torch.Tensor] = {}

    def share(self, t: torch.Tensor, event_handle: bytes) -> schema.CudaIpcTensor:
        handle = secrets.token_bytes(cuda_ref.IPC_HANDLE_BYTES)
        self.REGISTRY[handle] = t
        rows = as_rows(t)
        return schema.CudaIpcTensor(
            dtype="float32", shape=list(rows.shape), stride=list(rows.stride()), storage_offset=0,
            device_uuid="local", handle=handle, storage_size_bytes=t.numel(), storage_offset_bytes=0,
            ref_counter_handle="/torch_1_1_1", ref_counter_offset=0, event_handle=b"", event_sync_required=False,
            step_event_handle=event_handle)

    def new_event(self, device):
        return None, secrets.token_bytes(cuda_ref.IPC_HANDLE_BYTES)

    def open(self, ref: cuda_ref.CudaIpcRef, device, field: str) -> torch.Tensor:
        t = self.REGISTRY.get(ref.handle)
        if t is None:
            raise invalid(f"{field}.handle", "no such local buffer")
        return t

    def open_event(self, handle: bytes, device, field: str):
        return None

    @staticmethod
    def record(event, device) -> None:
        return None

    @staticmethod
    def wait(event, device) -> None:
        return None

    @staticmethod
    def synchronize(event) -> None:
        return None

    # ---- armed steps: CPU work is synchronous, so a word is written at once and a wait is the
    # caller's to emulate (drafter.service.bound_ipc runs a step queued ahead once its word is there)
    @staticmethod
    def can_arm() -> bool:
        return True

    @staticmethod
    def copy_words(dst: torch.Tensor, src: torch.Tensor, device) -> None:
        dst.view(torch.uint8).copy_(src.view(torch.uint8))

    @staticmethod
    def wait_word(word: torch.Tensor, value: int, device) -> None:
        return None

    @staticmethod
    def release_word(word: torch.Tensor, value: int, device) -> None:
        word.fill_(value)
