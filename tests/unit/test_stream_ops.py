"""drafter.wire.stream_ops without a CUDA driver: it says so, and every call raises the same error
(the armed cuda_ipc binding then is not granted: cuda_slab.TorchSlabs.can_arm)."""

from __future__ import annotations

import pytest

from drafter.wire import cuda_slab, stream_ops


def test_without_a_driver_nothing_is_queued_and_the_binding_is_not_armed(monkeypatch):
    def no_driver(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    stream_ops._driver.cache_clear()
    monkeypatch.setattr(stream_ops.ctypes, "CDLL", no_driver)
    try:
        assert not stream_ops.available()
        assert not cuda_slab.TorchSlabs.can_arm()
        for call in (lambda: stream_ops.wait_geq(0, 0, 1), lambda: stream_ops.write(0, 0, 1),
                     lambda: stream_ops.copy_to_device(0, 0, 0, 4)):
            with pytest.raises(stream_ops.StreamOpsUnavailable, match="no CUDA driver"):
                call()
    finally:
        stream_ops._driver.cache_clear()


def test_a_driver_error_is_raised_with_its_code():
    with pytest.raises(RuntimeError, match="cuStreamWaitValue32 failed: CUDA driver error 1"):
        stream_ops._check(1, "cuStreamWaitValue32")
    stream_ops._check(0, "anything")  # CUDA_SUCCESS
