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


def _span(t) -> tuple[int, int]:
    """[first byte, end) of a tensor's whole storage."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _merged(spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The union of the spans as disjoint sorted [start, end) intervals (starts, ends: uint64):
    an address lies in some span exactly when it lies in one of these."""
    starts: list[int] = []
    ends: list[int] = []
    for lo, hi in sorted(s for s in spans if s[1] > s[0]):
        if starts and lo <= ends[-1]:
            ends[-1] = max(ends[-1], hi)
        else:
            starts.append(lo)
            ends.append(hi)
    return np.asarray(starts, dtype=np.uint64), np.asarray(ends, dtype=np.uint64)


@contextlib.contextmanager
def checking():
    try:
        import triton.runtime.interpreter as interp

        executor, builder = interp.GridExecutor, interp.InterpreterBuilder
        originals = (executor.__call__, builder.create_masked_store, builder.create_masked_load)
    except (ImportError, AttributeError):
        yield False
        return
    # per running launch: [kernel name, its tensor arguments' spans, the merged spans (made at its first access)]
    ranges: list[list] = []

    def call(self, *args, **kwargs):
        spans = [_span(a) for a in (*args, *kwargs.values()) if hasattr(a, "untyped_storage")]
        ranges.append([self.fn.__name__, spans, None])
        try:
            return originals[0](self, *args, **kwargs)
        finally:
            ranges.pop()

    def check(ptrs, mask, what):
        if not ranges:
            return
        launch = ranges[-1]
        if launch[2] is None:  # the allowed tensors cannot change while a launch runs: no test code runs meanwhile
            launch[2] = _merged(launch[1] + [_span(t) for group in _ALLOWED for t in group])
        starts, ends = launch[2]
        addr = np.asarray(ptrs.data[mask.data] if mask is not None else ptrs.data, dtype=np.uint64).ravel()
        if len(starts):
            at = np.searchsorted(starts, addr, side="right") - 1  # the last span starting at or below each address
            inside = (at >= 0) & (addr < ends[np.maximum(at, 0)])
        else:
            inside = np.zeros(addr.shape, dtype=bool)
        if not inside.all():
            name = launch[0]
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
