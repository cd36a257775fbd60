"""tests/support/triton_interp.py: under the interpreter, a kernel's helper calls skip re-patching
triton.language while the launch has it patched, and what the kernel computes is unchanged."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the shortcut is for the Triton interpreter (CPU runs)", allow_module_level=True)
triton = pytest.importorskip("triton", reason="triton is not installed")
import triton.language as tl  # noqa: E402

from tests.support import triton_interp  # noqa: E402
from tests.support.triton_interp import skip_repatching  # noqa: E402


@triton.jit
def _row_sums_kernel(x_ptr, out_ptr, WIDTH: tl.constexpr):
    row = tl.program_id(0)
    values = tl.load(x_ptr + row * WIDTH + tl.arange(0, WIDTH))
    tl.store(out_ptr + row, tl.sum(values, axis=0) + tl.max(values, axis=0))  # two helpers per program


def test_helper_calls_patch_once_per_launch_and_compute_the_same(monkeypatch):
    assert skip_repatching()  # conftest installed it; installing again keeps one shortcut
    inner = triton_interp._real["patch_lang"]
    calls = []

    def counted(fn):
        calls.append(fn.__name__)
        return inner(fn)
    monkeypatch.setitem(triton_interp._real, "patch_lang", counted)
    x = torch.arange(16 * 8, dtype=torch.float32).view(16, 8)
    out = torch.empty(16)
    _row_sums_kernel[(16,)](x, out, WIDTH=8)
    assert torch.equal(out, x.sum(1) + x.max(1).values)
    # the launch's own patch, then each helper module's first call: not 16 programs x 2 helpers
    assert calls[0] == "_row_sums_kernel" and len(calls) <= 3, calls
