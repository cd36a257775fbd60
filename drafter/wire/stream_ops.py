"""CUDA stream memory operations: one GPU waits for a word another process's GPU writes.

The armed cuda_ipc step (drafter.service.bound_ipc) needs a stream that waits, on the GPU, for
a 32-bit word in device memory to reach a value, and a stream that writes such a word after
its earlier work: the CUDA driver's cuStreamWaitValue32 / cuStreamWriteValue32 (stream memory
operations, on by default since CUDA 11.7 on every GPU torch supports here), and an
asynchronous host-to-device copy of a small record on a given stream (cuMemcpyHtoDAsync).
torch exposes none of the three, and no maintained Python package on the registries wraps them
without pulling a whole CUDA toolkit binding (cuda-python), so the three entry points are called
here through ctypes from the driver torch already loaded.

The word is compared cyclically (GEQ: (int32)(word - value) >= 0), so a step counter may wrap.
Writes are fenced (CU_STREAM_WRITE_VALUE_DEFAULT): the stream's earlier writes are visible
before the word is.  Only addresses of device memory the calling process has mapped (its own,
or another process's opened through CUDA IPC) are valid; the caller's current CUDA device must
be the stream's.  Neutral: imports neither the engine, the service nor the clients.
"""

from __future__ import annotations

import ctypes
import functools

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: cyclic (int32)(*addr - value) >= 0
WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write
MASK32 = 0xFFFFFFFF


class StreamOpsUnavailable(RuntimeError):
    """The driver has no stream memory operations here (no CUDA, or a driver without them)."""


@functools.lru_cache(maxsize=1)
def _driver():
    """The driver's three entry points, typed; StreamOpsUnavailable where it has none."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise StreamOpsUnavailable(f"no CUDA driver: {exc}") from None

    def entry(*names):
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                return fn
        raise StreamOpsUnavailable(f"the CUDA driver has none of {names}")

    wait = entry("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
    write = entry("cuStreamWriteValue32_v2", "cuStreamWriteValue32")
    copy = entry("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync")
    for fn in (wait, write):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
    copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    copy.restype = ctypes.c_int
    return wait, write, copy


def available() -> bool:
    """Whether this process can queue stream memory operations (a CUDA driver with them)."""
    try:
        _driver()
    except StreamOpsUnavailable:
        return False
    return True


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUDA driver error {rc}")


def wait_geq(stream: int, addr: int, value: int) -> None:
    """Queue on `stream` (a CUstream handle) a wait until the 32-bit word at device address
    `addr` reaches `value` (cyclically)."""
    _check(_driver()[0](stream, addr, value & MASK32, WAIT_GEQ), "cuStreamWaitValue32")


def write(stream: int, addr: int, value: int) -> None:
    """Queue on `stream` the write of `value` to the 32-bit word at `addr`, after a fence."""
    _check(_driver()[1](stream, addr, value & MASK32, WRITE_DEFAULT), "cuStreamWriteValue32")


def copy_to_device(stream: int, dst: int, src: int, nbytes: int) -> None:
    """Queue on `stream` a copy of `nbytes` from pinned host memory at `src` to device memory at
    `dst` (read when the copy runs: keep the source unchanged until then)."""
    _check(_driver()[2](dst, src, nbytes, stream), "cuMemcpyHtoDAsync")
