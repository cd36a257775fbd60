"""The leader -> worker step channel: a small header over a pipe, the tensors in one broadcast.

Each step the leader sends every worker a `Header` (what to run, its options, and the shape and
dtype of each tensor) over its multiprocessing pipe, then broadcasts the tensors packed into one
byte buffer over the process group (NCCL on GPUs, gloo on CPU), so a step costs one collective
whatever its number of tensors.  A worker blocks on its pipe between steps, so an idle server
holds no collective open (a collective timeout only ever bounds a step in progress), and a leader
that dies closes the pipe: the worker's recv() ends with EOFError and it exits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 16  # every tensor starts on a 16-byte edge of the buffer (any dtype may view it)

DRAFT = "draft"
ZERO_BLOCKS = "zero_blocks"
STOP = "stop"


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class Header:
    op: str
    options: object = None  # the step's typed record (steps.DraftOptions, steps.BlockWipe), picklable
    tensors: tuple[TensorSpec | None, ...] = ()  # None: that slot carries no tensor

    @property
    def payload_bytes(self) -> int:
        return sum(_padded(t.nbytes) for t in self.tensors if t is not None)


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(tensors: list[torch.Tensor | None], device: torch.device) -> tuple[tuple, torch.Tensor]:
    """(specs, one uint8 buffer on `device` holding every tensor's bytes at 16-byte edges)."""
    specs = tuple(None if t is None else TensorSpec(tuple(t.shape), t.dtype) for t in tensors)
    total = sum(_padded(s.nbytes) for s in specs if s is not None)
    buf = torch.zeros(max(total, ALIGN), dtype=torch.uint8, device=device)
    offset = 0
    for t, s in zip(tensors, specs):
        if t is None:
            continue
        if s.nbytes:
            buf[offset: offset + s.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        offset += _padded(s.nbytes)
    return specs, buf


def unpack(specs: tuple, buf: torch.Tensor) -> list[torch.Tensor | None]:  # buf: [payload_bytes] uint8
    """The tensors pack() wrote, as views of `buf` (the buffer must stay alive while they are used)."""
    out, offset = [], 0
    for s in specs:
        if s is None:
            out.append(None)
            continue
        out.append(buf[offset: offset + s.nbytes].view(s.dtype).view(s.shape))
        offset += _padded(s.nbytes)
    return out


def comm_device(engine_device: torch.device) -> torch.device:
    """Where the broadcast buffer lives: the rank's GPU under NCCL, the host under gloo."""
    return engine_device if engine_device.type == "cuda" else torch.device("cpu")


class LeaderChannel:
    """Rank 0's end: one pipe per worker (ranks 1 .. N-1, in order) plus the process group."""

    def __init__(self, pipes: list, device: torch.device):
        self.pipes = pipes
        self.device = comm_device(device)

    def send(self, op: str, options: object = None, tensors: list[torch.Tensor | None] = ()) -> None:
        specs, buf = pack(list(tensors), self.device)
        header = Header(op, options, specs)
        for pipe in self.pipes:
            pipe.send(header)
        if header.tensors:
            torch.distributed.broadcast(buf, src=0)

    def stop(self) -> None:
        """Ask every worker to exit (best effort: a worker already gone is no error here)."""
        for pipe in self.pipes:
            try:
                pipe.send(Header(STOP))
            except (OSError, ValueError):
                pass


class WorkerChannel:
    """A worker's end: its pipe from the leader plus the process group."""

    def __init__(self, pipe, device: torch.device):
        self.pipe = pipe
        self.device = comm_device(device)

    def receive(self) -> tuple[Header, list[torch.Tensor | None]]:
        """The next step's header and tensors (EOFError: the leader is gone)."""
        header: Header = self.pipe.recv()
        if not header.tensors:
            return header, []
        buf = torch.empty(max(header.payload_bytes, ALIGN), dtype=torch.uint8, device=self.device)
        torch.distributed.broadcast(buf, src=0)
        return header, unpack(header.tensors, buf)
