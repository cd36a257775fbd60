"""Who may use CUDA IPC with whom: host identity, GPU identity, and what a drafter advertises.

A reference is only useful to a drafter on the same host whose GPU can read the memory, and the
two must agree on that without trying: the drafter advertises CudaIpcSupport in Attach and Info
(the host's boot id, the uuids of the GPUs it can read), the client shares only where its own
boot id and its tensor's GPU uuid match.  The boot id is the kernel's: equal for every process
(and container) of one boot of one host, different on any other host.  GPUs are named by uuid
because indices differ between processes with different CUDA_VISIBLE_DEVICES.

Policy (`drafter serve --allow-cuda-ipc auto|true|false`, DRAFTER_ALLOW_CUDA_IPC): auto enables it
when the server binds a loopback address only (every peer is then on this host, and ipc:// is
local by construction); a drafter listening on the network needs `true`, because opening a
reference maps memory of whatever local process the handle names, and a remote peer has no
business naming one.  It is never enabled on a CPU device.
"""

from __future__ import annotations

import ipaddress

import torch

from drafter.wire import schema
from drafter.wire.cuda_ref import BOOT_ID, device_uuid, host_id

MAX_PEERS = 64  # schema.CudaIpcSupport.device_uuids bound


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed(setting: str, host: str) -> tuple[bool, str]:
    """(allowed, why not) for --allow-cuda-ipc `setting` on a server bound to `host`."""
    if setting == "false":
        return False, "disabled (--allow-cuda-ipc false)"
    if setting == "auto" and not is_loopback(host):
        return False, f"the drafter listens on {host}, not loopback only (--allow-cuda-ipc true enables it)"
    return True, ""


def readable_devices(device: torch.device) -> list[str]:
    """Uuids of the GPUs whose memory `device` can read: itself first, then its peers."""
    own = torch.device(device).index or 0
    peers = [i for i in range(torch.cuda.device_count())
             if i != own and torch.cuda.can_device_access_peer(own, i)]
    return [device_uuid(torch.device("cuda", i)) for i in [own, *peers][:MAX_PEERS]]


def advertise(device, allow: bool, why_not: str) -> schema.CudaIpcSupport:
    """What Attach and Info say about CUDA IPC for an engine on `device`."""
    device = torch.device(device)
    if not allow:
        return schema.CudaIpcSupport(enabled=False, reason=why_not)
    if device.type != "cuda":
        return schema.CudaIpcSupport(enabled=False, reason=f"the drafter runs on {device.type}, not a CUDA device")
    hid = host_id()
    if not hid:
        return schema.CudaIpcSupport(enabled=False, reason=f"no host identity ({BOOT_ID} is unreadable)")
    return schema.CudaIpcSupport(enabled=True, host_id=hid, device_uuids=readable_devices(device))
