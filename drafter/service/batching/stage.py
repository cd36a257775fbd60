"""Staging a call's CPU tensors in one reusable host buffer (pinned on a GPU host)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from drafter.wire.records import INPUT_FIELDS, ProposeInputs


def _bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16 as its int16 bits), any strides."""
    if t.requires_grad:
        t = t.detach()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _cpu_bits(v) -> np.ndarray | None:
    """What HostStager copies of a call's value: a CPU tensor's bits; None: passed through as it is."""
    return _bits(v) if isinstance(v, torch.Tensor) and v.is_cpu else None


LIST_INPUTS = ("block_tables", "slot_mappings")  # one tensor per KV group
SINGLE_INPUTS = tuple(n for n in INPUT_FIELDS if n not in LIST_INPUTS)


class HostStager:
    """One reusable host buffer the engine thread copies a call's tensors into (pinned for a GPU).

    Pinned memory is mapped into the GPU's address space: the engine's captured loader reads a
    staged call in place (no copy launches, no synchronous pageable copies), and a copy from it
    is an asynchronous DMA.  It is allocated once (grown geometrically, up to the largest call
    the engine accepts) and reused by every call: the engine thread runs one call at a time and
    waits for its drafts on the host before the next, so the GPU has read the buffer by then.
    """

    def __init__(self, max_bytes: int, pin: bool = True):
        self.max_bytes = max_bytes
        self.pin = pin
        self.buf: torch.Tensor | None = None
        self.buf_np: np.ndarray | None = None  # the same bytes: numpy slices cost a fraction of torch's
        self.views: dict[np.dtype, np.ndarray] = {}  # buf_np as each dtype staged so far
        self.allocations = 0
        self.last: ProposeInputs | None = None  # what the buffer holds now

    def stage(self, inp: ProposeInputs) -> ProposeInputs:
        """inp with every CPU tensor (lists of them too) replaced by a copy in the buffer, each at a
        64-byte boundary; inp unchanged where it does not fit (the engine refuses such calls anyway)
        or is what the buffer holds already."""
        if inp is self.last:
            return inp
        singles = {n: _cpu_bits(getattr(inp, n)) for n in SINGLE_INPUTS}
        lists = {n: [_cpu_bits(t) for t in getattr(inp, n) or ()] for n in LIST_INPUTS}
        arrays = [a for a in (*singles.values(), *(a for v in lists.values() for a in v)) if a is not None]
        nbytes = sum(_aligned(a.nbytes) for a in arrays)
        if not arrays or nbytes > self.max_bytes:
            return inp
        self._reserve(nbytes)
        changes, offset = {}, 0
        for name, a in singles.items():
            if a is not None:
                changes[name], offset = self._place(a, getattr(inp, name).dtype, offset)
        for name, parts in lists.items():
            if not parts:
                continue
            staged = changes[name] = list(getattr(inp, name))
            for i, a in enumerate(parts):
                if a is not None:
                    staged[i], offset = self._place(a, staged[i].dtype, offset)
        self.last = replace(inp, **changes)
        return self.last

    def _reserve(self, nbytes: int) -> None:
        if self.buf is not None and self.buf.numel() >= nbytes:
            return
        size = min(self.max_bytes, max(nbytes, 2 * (self.buf.numel() if self.buf is not None else 0)))
        self.buf = torch.empty(_aligned(size), dtype=torch.uint8, pin_memory=self.pin)  # any dtype can view it
        self.buf_np, self.views = self.buf.numpy(), {}
        self.allocations += 1

    def _place(self, src: np.ndarray, dtype: torch.dtype, offset: int) -> tuple[torch.Tensor, int]:
        """src copied into the buffer at byte `offset`, as a tensor of `dtype`; and the next free offset."""
        view = self.views.get(src.dtype)
        if view is None:
            view = self.views[src.dtype] = self.buf_np.view(src.dtype)
        start = offset // src.itemsize
        dst = view[start:start + src.size]
        if src.ndim != 1:
            dst = dst.reshape(src.shape)
        dst[...] = src  # numpy's copy: several times torch's copy_ for bf16 (and cheaper to call than np.copyto)
        staged = torch.from_numpy(dst)
        return staged.view(torch.bfloat16) if dtype == torch.bfloat16 else staged, offset + _aligned(src.nbytes)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64
