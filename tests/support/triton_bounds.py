"""Bounds checking for Triton kernels under the interpreter.

The interpreter turns every load and store into raw memory accesses: a kernel that indexes past
a tensor reads or corrupts whatever lies next to it, and the result then depends on the
allocator's layout (a bug that came and went with unrelated allocations).  `checking()` makes
every masked-in address of a load or store lie inside the storage of one of the launch's tensor
arguments, and raises naming the kernel otherwise.  It patches interpreter internals; where
they differ (another Triton version) it checks nothing and says so.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest


class OutOfBounds(AssertionError):
    pass


_ALLOWED: list = []  # tensors a kernel may reach through addresses it was handed in memory


@contextlib.contextmanager
def allowing(tensors):
    """Also accept accesses to these tensors (a loader reads the call's inputs by address)."""
    _ALLOWED.append([t for t in tensors if hasattr(t, "untyped_storage")])
    try:
        yield
    finally:
        _ALLOWED.pop()


@contextlib.contextmanager
def allowing_outputs(runner):
    """Also accept stores into every output tensor `runner` (a GraphRunner) allocates meanwhile:
    the loop graph's last kernel stores the drafts through the address in the call's header."""
    made: list = []
    new_output = runner.new_output

    def tracked(batch):
        out = new_output(batch)
        made.append(out)
        return out

    runner.new_output = tracked
    _ALLOWED.append(made)  # read at each check: outputs made later count too
    try:
        yield made
    finally:
        _ALLOWED.pop()
        del runner.new_output  # the class's method again


@contextlib.contextmanager
def checking():
    try:
        import triton.runtime.interpreter as interp

        executor, builder = interp.GridExecutor, interp.InterpreterBuilder
        originals = (executor.__call__, builder.create_masked_store, builder.create_masked_load)
    except (ImportError, AttributeError):
        yield False
        return
    ranges: list[tuple[str, list[tuple[int, int]]]] = []

    def call(self, *args, **kwargs):
        spans = [(a.untyped_storage().data_ptr(), a.untyped_storage().data_ptr() + a.untyped_storage().nbytes())
                 for a in (*args, *kwargs.values()) if hasattr(a, "untyped_storage")]
        ranges.append((self.fn.__name__, spans))
        try:
            return originals[0](self, *args, **kwargs)
        finally:
            ranges.pop()

    def check(ptrs, mask, what):
        if not ranges:
            return
        name, spans = ranges[-1]
        addr = np.asarray(ptrs.data[mask.data] if mask is not None else ptrs.data, dtype=np.uint64).ravel()
        inside = np.zeros(addr.shape, dtype=bool)
        extra = [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                 for group in _ALLOWED for t in group]
        for lo, hi in spans + extra:
            inside |= (addr >= lo) & (addr < hi)
        if not inside.all():
            raise OutOfBounds(f"{name}: {what} of {int((~inside).sum())} element(s) outside every tensor argument")

    def store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, "store")
        return originals[1](self, ptrs, value, mask, *rest)

    def load(self, ptrs, mask, other, *rest):
        check(ptrs, mask, "load")
        return originals[2](self, ptrs, mask, other, *rest)

    executor.__call__, builder.create_masked_store, builder.create_masked_load = call, store, load
    try:
        yield True
    finally:
        executor.__call__, builder.create_masked_store, builder.create_masked_load = originals


@pytest.fixture(autouse=True)
def bounds_checked():
    """Under the interpreter (no GPU), every kernel access of the test must stay inside its
    tensors: a store of a padded row past an output would raise.  Import it into a test module
    to have it there; on a GPU it checks nothing."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    with checking():
        yield
