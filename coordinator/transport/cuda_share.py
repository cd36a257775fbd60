"""Client side of CUDA IPC: a reference to the target's GPU hidden states instead of their bytes.

    client = ZmqDrafterClient(endpoint, share_cuda=True)     # or GrpcDrafterClient(..., share_cuda=True)

A reference goes instead of the bytes only when all of these hold (otherwise the bytes travel, as
without the option):
  * the drafter advertised CudaIpcSupport in its AttachResponse, with this host's boot id and the
    uuid of the GPU holding the tensor (drafter.wire.cuda_ref);
  * target_hidden_states is a CUDA tensor of a float dtype, 2-D, unit column stride.

Each storage is shared once, with torch's own producer side (UntypedStorage._share_cuda_, what
torch.multiprocessing sends), and the same reference goes every step: keep the hidden states in a
static buffer.  The client holds the storages it shared (at most 8, least recently used out), so
their memory cannot be reused while a reference to it is out.  Ordering: each step records one
interprocess event on the current stream of the tensor's device (so the states must have been
written on that stream, or before it); the drafter waits for it.  Lifetime: the buffer may be
rewritten once propose() has returned (see proto CudaIpcTensor).

If the drafter refuses a reference for reasons of this environment (it cannot open the handle, read
that GPU or open the event: e.g. another container), this client stops sharing and sends the same
step again with bytes, within what is left of its timeout.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Callable

import msgspec
import torch

from drafter.wire import cuda_ref
from drafter.wire.cuda_ref import ENVIRONMENT_FIELDS, HIDDEN_DTYPE_NAMES, CudaIpcRef
from drafter.wire.errors import Code, DrafterError
from drafter.wire.records import ProposeRequest

log = logging.getLogger("coordinator.transport.cuda_share")
MAX_BUFFERS = 8  # the drafter keeps as many open per session
CAPABLE = "cuda_ipc_capable"  # the request flag that asks a drafter for its CudaIpcSupport


class CudaShare:
    def __init__(self, enabled: bool, *, max_buffers: int = MAX_BUFFERS, host_id: Callable[[], str] | None = None,
                 device_uuid: Callable[[torch.device], str] | None = None):
        """host_id / device_uuid: drafter.wire.cuda_ref's (replaceable in tests)."""
        self.enabled = enabled
        self.reason = "" if enabled else "share_cuda is off"
        self.max_buffers = max_buffers
        self._host_id = host_id or cuda_ref.host_id
        self._device_uuid = device_uuid or cuda_ref.device_uuid
        self._host: str | None = None
        self._uuids: dict[torch.device, str] = {}
        self.exports: OrderedDict = OrderedDict()  # storage data_ptr -> (storage, torch's share tuple)
        self.events: dict[torch.device, tuple] = {}  # device -> (interprocess event, its IPC handle)

    # ------------------------------------------------------------------ deciding
    def usable(self, t, support) -> bool:
        """t: target_hidden_states [num_tokens, hidden_width]; support: the AttachResponse's CudaIpcSupport."""
        if not (self.enabled and support is not None and support.enabled and isinstance(t, torch.Tensor)):
            return False
        if not t.is_cuda or t.dtype not in HIDDEN_DTYPE_NAMES or t.dim() != 2 or t.stride(1) != 1:
            return False
        if t.stride(0) < t.shape[1] or support.host_id != self.host():
            return False
        return self.uuid(t.device) in support.device_uuids

    def host(self) -> str:
        if self._host is None:
            self._host = self._host_id()
        return self._host

    def uuid(self, device: torch.device) -> str:
        if device not in self._uuids:
            self._uuids[device] = self._device_uuid(device)
        return self._uuids[device]

    # ------------------------------------------------------------------ asking
    def ask(self, req, send):
        """send(req) for an AttachRequest or InfoRequest, flagged cuda_ipc_capable while sharing is on (the
        drafter answers with its CudaIpcSupport only when asked).  A drafter older than CUDA IPC refuses
        the flag by name over ZMQ: then sharing stops and the request goes again without it."""
        if not self.enabled:
            return send(req)
        try:
            return send(msgspec.structs.replace(req, cuda_ipc_capable=True))
        except DrafterError as err:
            if err.code != Code.INVALID_ARGUMENT or err.field != CAPABLE:
                raise
            self.stop("the drafter predates CUDA IPC")
        return send(req)

    # ------------------------------------------------------------------ the call
    def send(self, request: ProposeRequest, support, send: Callable, timeout: float):
        """send(request, timeout) is one call; with a reference the drafter refused for reasons of this
        environment, sharing stops and the step goes again with bytes."""
        deadline = time.monotonic() + timeout
        shared = self.share(request, support)
        if shared is None:
            return send(request, timeout)
        try:
            return send(shared, timeout)
        except DrafterError as err:
            if not self.refused(err):
                raise
        return send(request, max(1e-3, deadline - time.monotonic()))

    def share(self, request: ProposeRequest, support) -> ProposeRequest | None:
        """The request with a reference in place of its hidden states; None: they travel as bytes."""
        t = request.inputs.target_hidden_states
        if not self.usable(t, support):
            return None
        try:
            ref = self.reference(t)
        except RuntimeError as exc:  # e.g. a tensor this process itself received by IPC: torch cannot re-share it
            self.stop(f"torch cannot share the tensor: {exc}")
            return None
        return replace(request, inputs=replace(request.inputs, target_hidden_states=None), hidden_ipc=ref)

    def refused(self, err: DrafterError) -> bool:
        """True (and sharing stops) when the drafter cannot use this client's references at all."""
        if err.code != Code.INVALID_ARGUMENT or err.field not in ENVIRONMENT_FIELDS:
            return False
        self.stop(f"the drafter refused {err.field}: {err.message}")
        return True

    def stop(self, reason: str) -> None:
        self.enabled, self.reason = False, reason
        self.exports.clear()
        log.warning("CUDA IPC sharing off, sending hidden states as bytes: %s", reason)

    # ------------------------------------------------------------------ torch's producer side
    def reference(self, t: torch.Tensor) -> CudaIpcRef:
        """t: [num_tokens, hidden_width] on a GPU -> its reference, after recording this step's event."""
        share = self._export(t.untyped_storage())
        return CudaIpcRef(
            dtype=t.dtype, shape=tuple(t.shape), stride=tuple(t.stride()), storage_offset=t.storage_offset(),
            device_uuid=self.uuid(t.device), handle=bytes(share[1]), storage_size_bytes=int(share[2]),
            storage_offset_bytes=int(share[3]), ref_counter_handle=bytes(share[4]).decode(),
            ref_counter_offset=int(share[5]), event_handle=bytes(share[6]), event_sync_required=bool(share[7]),
            step_event_handle=self._step_event(t.device))

    def _export(self, storage: torch.UntypedStorage) -> tuple:
        key = storage.data_ptr()
        held = self.exports.get(key)
        if held is not None:
            self.exports.move_to_end(key)
            return held[1]
        # _share_cuda_: torch <= 2.1x; newer torch names it _share_device_ (same tuple)
        share_fn = getattr(storage, "_share_cuda_", None) or storage._share_device_
        share = share_fn()
        while len(self.exports) >= self.max_buffers:
            self.exports.popitem(last=False)
        self.exports[key] = (storage, share)  # held: the address stays this storage's while it is out
        return share

    def _step_event(self, device: torch.device) -> bytes:
        """Record this step's interprocess event on the device's current stream; its IPC handle."""
        stream = torch.cuda.current_stream(device)
        held = self.events.get(device)
        if held is None:
            event = torch.cuda.Event(interprocess=True)
            event.record(stream)  # created on the stream's device by its first record
            held = self.events[device] = (event, bytes(event.ipc_handle()))
        else:
            held[0].record(stream)
        return held[1]
