"""The test-only speed-ups of the Triton interpreter (tests/support/triton_interp.py) change nothing a
kernel computes or a check reports, and the bounds checker (tests/support/triton_bounds.py) still
names a kernel that reaches past its tensors."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the shortcuts are for the Triton interpreter (CPU runs)", allow_module_level=True)
triton = pytest.importorskip("triton", reason="triton is not installed")
import triton.language as tl  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

from triton.runtime.errors import InterpreterError  # noqa: E402  (a launch wraps what a program raised)

from tests.support import triton_interp  # noqa: E402
from tests.support.triton_bounds import OutOfBounds, _merged, checking  # noqa: E402


@triton.jit
def _doubled_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, x + x)  # an int32 add: Triton's overflow check applies


@triton.jit
def _shifted_copy_kernel(x_ptr, out_ptr, shift, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + shift + offs, tl.load(x_ptr + offs))


@triton.jit
def _broadcasts_kernel(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)  # int32: a pointer block plus an int block, then a splat of 3 below
    y = tl.load(y_ptr + offs)  # float32
    grid = x[:, None] * 3 + y[None, :]  # a real broadcast on each side, a splat, int -> float
    shift = tl.program_id(0) * 2 + 1  # scalar with scalar
    tl.store(out_ptr + offs[:, None] * N + offs[None, :], grid * y[None, :] + shift)  # one shape, then a splat


def test_the_conftest_installed_every_shortcut():
    assert triton_interp.install()  # installing again keeps one of each
    assert getattr(interp._get_np_dtype, "_memoized", False)
    assert "binary_op_sanitize_overflow_impl" in vars(interp.interpreter_semantic)
    assert getattr(tl.block_type.__init__, "_shared", False)
    assert "broadcast_impl_value" in vars(interp.interpreter_semantic)


def _own_block(element_ty, shape) -> tl.block_type:
    block = object.__new__(tl.block_type)
    triton_interp._real["block_init"](block, element_ty, shape)
    return block


def test_shared_block_types_and_tensor_shapes_are_tritons_own():
    elements = [tl.int1, tl.int32, tl.uint32, tl.int64, tl.float16, tl.bfloat16, tl.float32,
                tl.pointer_type(tl.float32), tl.pointer_type(tl.float32, const=True),
                tl.pointer_type(tl.float32, "shared"), tl.pointer_type(tl.pointer_type(tl.int8))]
    for element in elements:
        for shape in ([4], [1, 8], [2, 1, 16], tl.block_type(tl.int8, [2, 4]).shape):
            for _ in range(2):  # the second one takes what the first computed
                got, want = tl.block_type(element, shape), _own_block(element, shape)
                assert got == want and got.element_ty is element
                assert (got.shape.values, got.numel, got.name) == (want.shape.values, want.numel, want.name)
                assert tl.block_type(tl.int8, [16, 2]).shape.values == [16, 2], "a shared shape is never changed"
                t, own = tl.tensor(None, got), object.__new__(tl.tensor)
                triton_interp._real["tensor_init"](own, None, want)
                assert t.type is got and t.dtype == own.dtype and t.numel.value == own.numel.value
                assert [d.value for d in t.shape] == [d.value for d in own.shape]
        scalar = tl.tensor(None, element)
        assert scalar.shape.values == [] and scalar.numel.value == 1 and scalar.dtype == element
    for shape, error in (([3], ValueError), ([], TypeError), ((4,), AssertionError)):
        for _ in range(2):  # refused every time, as Triton's own constructor refuses it
            with pytest.raises(error):
                tl.block_type(tl.float32, shape)


def test_broadcasts_compute_as_tritons_own(monkeypatch):
    semantic = interp.interpreter_semantic
    one = interp.TensorHandle(np.array([3], dtype=np.int32), tl.int32)
    row = interp.TensorHandle(np.arange(4, dtype=np.int32), tl.int32)
    a, b = tl.tensor(one, tl.int32), tl.tensor(row, tl.block_type(tl.int32, [4]))
    assert semantic.broadcast_impl_value(a, a) == (a, a) == triton_interp._real["broadcast_impl_value"](semantic, a, a)
    assert semantic.broadcast_impl_value(b, b) == (b, b) == triton_interp._real["broadcast_impl_value"](semantic, b, b)
    lhs, rhs = semantic.broadcast_impl_value(b, a)  # a splat: Triton's own
    assert lhs is b and rhs.type == b.type and rhs.handle.data.tolist() == [3] * 4
    x = torch.tensor([5, -2, 7, 1], dtype=torch.int32)
    y = torch.tensor([0.5, -1.0, 2.0, 3.0])
    outs = []
    for shortcuts in (True, False):
        if not shortcuts:
            monkeypatch.delattr(semantic, "broadcast_impl_value")
            monkeypatch.setattr(tl.block_type, "__init__", triton_interp._real["block_init"])
            monkeypatch.setattr(tl.tensor, "__init__", triton_interp._real["tensor_init"])
        outs.append(torch.empty(4, 4))
        _broadcasts_kernel[(2,)](x, y, outs[-1], N=4)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], (x[:, None] * 3 + y[None, :]) * y[None, :] + 3)  # the last program's shift


def test_the_memoized_dtype_lookup_answers_as_the_interpreters_own():
    own = triton_interp._real["np_dtype"]
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
               tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]
    types = scalars + [tl.pointer_type(tl.float32), tl.pointer_type(tl.int8)]
    types += [tl.block_type(t, [4, 2]) for t in types]
    for _ in range(2):  # the second pass answers from the memo
        for t in types:
            assert interp._get_np_dtype(t) == own(t), t


def test_an_overflowing_int32_add_computes_the_same_and_raises_only_where_triton_asserts(monkeypatch):
    x = torch.tensor([2 ** 31 - 1, -2 ** 31, 7, -3], dtype=torch.int32)
    with_shortcut = torch.empty_like(x)
    _doubled_kernel[(1,)](x, with_shortcut, N=4)
    monkeypatch.delattr(interp.interpreter_semantic, "binary_op_sanitize_overflow_impl")  # Triton's own check
    without = torch.empty_like(x)
    _doubled_kernel[(1,)](x, without, N=4)  # debug off: its condition is built, then dropped
    assert torch.equal(with_shortcut, without)
    assert with_shortcut.tolist() == [-2, 0, 14, -6]  # int32 wrap-around
    monkeypatch.undo()
    assert "binary_op_sanitize_overflow_impl" in vars(interp.interpreter_semantic)
    from dataclasses import replace

    monkeypatch.setattr(interp.interpreter_builder, "options", replace(interp.interpreter_builder.options, debug=True))
    with pytest.raises(InterpreterError, match="AssertionError.*int32 overflow detected for operation add"):
        _doubled_kernel[(1,)](x, torch.empty_like(x), N=4)  # debug on: the shortcut runs Triton's check


def test_the_merged_spans_hold_exactly_the_addresses_some_span_holds():
    rng = random.Random(5)
    for _ in range(200):
        spans = [(lo, lo + rng.choice([0, 1, 3, 8])) for lo in (rng.randrange(0, 40) for _ in range(rng.randrange(6)))]
        starts, ends = _merged(spans)
        assert all(ends[:-1] < starts[1:]) and all(starts < ends)  # disjoint, sorted, none empty
        for addr in range(0, 50):
            want = any(lo <= addr < hi for lo, hi in spans)
            at = int(np.searchsorted(starts, np.uint64(addr), side="right")) - 1
            assert (at >= 0 and addr < int(ends[at])) == want, (spans, addr)


def test_the_bounds_checker_names_a_kernel_that_stores_past_its_output():
    x = torch.arange(8, dtype=torch.float32)
    big = torch.zeros(16)
    out = big[:8]  # a view: the rest of its storage is still its tensor's
    with checking():
        _shifted_copy_kernel[(1,)](x, out, 8, N=8)  # into the view's storage: allowed
        assert torch.equal(big[8:], x)
        alone = torch.zeros(8)
        with pytest.raises(InterpreterError, match=f"{OutOfBounds.__name__}.*_shifted_copy_kernel: store of 1 element"):
            _shifted_copy_kernel[(1,)](x, alone, 1, N=8)  # the last element lands one past its storage
