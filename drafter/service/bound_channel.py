"""Bound sessions on the nccl_channel plane: the ring's bytes GPU to GPU over NCCL, no IPC.

    Bind (plane "nccl_channel", drafter.service.bound_sessions dispatches here):
        refused (FAILED_PRECONDITION "plane") where the engine is not on a GPU or torch has no NCCL,
        and ("device_uuid") where the target's GPU is the engine's (NCCL refuses two ranks on one GPU)
        a slab in the ring's layout on the engine's GPU, the step guard over views of it, the engine
        bound to the guard's outputs and the slab's hidden states (drafter.service.bound_ipc._Guarded)
        a TCPStore for the binding (BindResponse.store); the data thread joins the two-rank NCCL
        group as rank 1 and exchanges a word each way with the target (drafter.wire.bound_channel.
        handshake: NCCL connects each direction there, never inside a step)
    each step ([identity, StepHeader] on the session's data socket), on the data thread:
        header read; a header that cannot be read, or an nbytes the slab cannot hold, ends the
            binding (the channel's bytes could not be told apart from the next step's: bind again)
        recv of the slab's first nbytes from the target posted (its own NCCL stream, from an idle
            side stream: it starts at once, not after other sessions' queued steps)
        under the engine's lock: the sizes checked on the host, the stream waits on the recv (no host
            sync), guard.step (checks and masks every field, the error word into the output),
            bound.propose (drafts into the output), an event recorded; no NCCL call under the lock
        off the lock: one send of the whole output to the target, from the side stream after the event
        [identity, StepDone] at once, stamped as on cuda_ipc; a refused step sends no output

The target posts its recv of the output only after a StepDone with code 0, so both ends' operations
stay paired whatever the drafter refuses.  The step's transfers run on NCCL's stream and the
engine's stream waits on them on the GPU; a target gone mid-transfer leaves that wait pending until
the group's timeout aborts its communicator (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, set by
drafter.wire.bound_channel.open_group): the engine's stream waits at most that long.

BACKEND chooses the group's backend: NCCL; the CPU tests put gloo here to run this same session on
host tensors (the guard eagerly on the CPU, the output sent by gloo).
"""

from __future__ import annotations

import datetime
import time

import torch

from drafter.service.bound_ipc import _Doorbell, _engine_device, _Guarded, on_engine
from drafter.service.bound_sessions import BoundSession, _view
from drafter.wire import bound as wb
from drafter.wire import bound_channel as bc
from drafter.wire import cuda_ref
from drafter.wire.errors import Code, DrafterError, invalid

BACKEND = bc.NCCL  # the tests put bc.GLOO here (a CPU engine, host tensors)
JOIN_TIMEOUT = datetime.timedelta(seconds=30)  # the target's join and handshake; each transfer's NCCL timeout


def check_plane(engine, req: wb.BindRequest) -> torch.device:
    """The engine's device where it can serve this nccl_channel binding; FAILED_PRECONDITION naming
    "plane" (no GPU engine, no NCCL) or "device_uuid" (the target's GPU is the engine's)."""
    device = _engine_device(engine)
    if BACKEND == bc.GLOO:
        return device
    if device.type != "cuda" or not bc.nccl_available():
        raise DrafterError(Code.FAILED_PRECONDITION, "plane",
                           f"nccl_channel needs the drafter's engine on a GPU and torch with NCCL "
                           f"(engine on {device}, NCCL {'built' if bc.nccl_available() else 'not available'})")
    if not req.device_uuid:
        raise invalid("device_uuid", "an nccl_channel binding names the target's GPU")
    if req.device_uuid == cuda_ref.device_uuid(device):
        raise DrafterError(Code.FAILED_PRECONDITION, "device_uuid",
                           f"the target's GPU is the drafter's ({device}): NCCL refuses two ranks on one GPU; "
                           "bind cuda_ipc or host_ring, or run the drafter on another GPU")
    return device


class ChannelSession(_Doorbell, _Guarded, BoundSession):
    """One session bound over a NCCL channel: the slab on the engine's GPU, the guard, the output
    sent back by the channel."""

    def __init__(self, plane, s, req: wb.BindRequest, slots: list[wb.Slot], total: int):
        self._own(plane, s, slots)
        engine = self.core.engine
        self.device = check_plane(engine, req)
        self.slab = torch.zeros(total, dtype=torch.uint8, device=self.device)  # [total]: the target's step lands here
        self.ring = torch.empty(0, dtype=torch.uint8)  # no bytes arrive on the data socket
        self.views = {sl.name: _view(self.slab, sl) for sl in slots}
        self.groups = len(s.num_blocks)
        self._bind_engine(engine, s, req.max_batch)  # self.output: [output_words] int64 (drafts, error word)
        self._sent = None  # the last step's send of the output (the next step orders after it)
        # the stream the prefix's recv is posted from: an idle one, so the recv starts at once (the
        # slab is free by then: the target sends a step only after it received the last one's output,
        # which this side sends after that step's replay)
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._done = torch.cuda.Event() if self.device.type == "cuda" else None  # a step's replay queued
        self._link_state(req)
        self._open_doorbell(req)  # on one host the header may come by the doorbell (bound_ipc._Doorbell)

    # ------------------------------------------------------------------ the channel
    def stop(self) -> None:
        """End the binding: its group aborted at once, so a data thread (or the engine's stream)
        waiting on one of its transfers is released rather than waiting for the group's timeout."""
        super().stop()
        bc.close_group(self.channel)

    def _open_channel(self):
        """The binding's NCCL group (rank 1), and the target's handshake word (the communicator built)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        group = bc.open_group(BACKEND, self.store, self.bind_id, bc.DRAFTER_RANK, JOIN_TIMEOUT)
        try:
            bc.handshake(group, bc.DRAFTER_RANK, self.device, time.monotonic() + JOIN_TIMEOUT.total_seconds(),
                         inputs=self.slab, output=self.output)
        except BaseException:
            bc.close_group(group)
            raise
        return group

    # the data socket's step is _Doorbell._receive_and_run: [StepHeader] only; the prefix comes down the
    # channel, the output goes back by it

    def _answer(self, header_frame: bytes, extra: int, received: int) -> tuple[wb.StepDone, list[int]]:
        """One step from its header frame (the data socket's or the doorbell's): StepDone, and the
        rows' accepted counts to record after the reply."""
        try:
            head = wb.STEP_DECODER.decode(header_frame)
        except Exception as exc:  # noqa: BLE001 - msgspec's errors name the path
            self._stop.set()  # how many bytes the target sent is unknown: the channel is out of step
            return wb.StepDone(step=0, code=int(Code.FAILED_PRECONDITION), field="header",
                               message=f"{exc}; the channel is closed, bind again"), []
        if not 0 < head.nbytes <= self.slab.numel():
            self._stop.set()
            return self._refused(head, DrafterError(Code.FAILED_PRECONDITION, "nbytes", (
                f"{head.nbytes} bytes do not fit the slab of {self.slab.numel()}; the channel is closed, "
                "bind again"))), []
        if self._side is not None:  # NCCL's stream then waits for nothing of the engine's (other sessions' steps)
            with torch.cuda.stream(self._side):
                arrived = self.channel.recv([self.slab[:head.nbytes]], bc.TARGET_RANK, 0)
        else:  # gloo: the host waits here, outside the engine's lock
            arrived = self.channel.recv([self.slab[:head.nbytes]], bc.TARGET_RANK, 0)
            arrived.wait()
        if extra:
            return self._refused(head, invalid("frames", "an nccl_channel step is [StepHeader] alone")), []
        try:
            self.admit(head)
            started, queued = on_engine(self, self._timed, head, arrived)
            self._send_output()
        except DrafterError as exc:
            return self._refused(head, exc), []
        except Exception as exc:  # noqa: BLE001 - a bug of ours: the step still gets its answer
            import logging

            logging.getLogger("drafter.service.bound").exception("nccl_channel bound step failed")
            return wb.StepDone(step=head.step, code=int(Code.INTERNAL), message=repr(exc)[:2000]), []
        return (wb.StepDone(step=head.step, stamps=[received, started, queued, time.perf_counter_ns()]),
                list(head.accepted_counts))

    def _timed(self, head: wb.StepHeader, arrived) -> tuple[int, int]:
        started = time.perf_counter_ns()
        self.run_channel_step(head, arrived)
        return started, time.perf_counter_ns()

    # ------------------------------------------------------------------ one step (engine lock held)
    def run_channel_step(self, head: wb.StepHeader, arrived) -> None:
        """Sizes on the host; then queued: wait for the prefix (and the last output's send), guard,
        replay, the replay's event (the output's send follows it, off the lock)."""
        self._check_sizes(head)
        want = wb.step_bytes(self.slots, head.num_tokens)
        if head.nbytes != want:
            raise invalid("ring", f"{head.nbytes} bytes for {head.num_tokens} tokens; the layout needs {want}")
        if self.device.type == "cuda":
            arrived.wait()  # the engine's stream waits for the prefix (NCCL's stream), no host sync
        if self._sent is not None:  # the last output's send done before the guard rewrites the output
            sent, self._sent = self._sent, None  # (GPU: the stream waits; gloo: done, the target had it)
            sent.wait()
        self._replay(head)
        if self._done is not None:
            self._done.record()  # the output's send (off the lock) starts after this step's replay

    def _send_output(self) -> None:
        """The whole output (drafts, error word) to the target, posted off the engine's lock (an NCCL
        call never holds it: one binding's channel must not stall other sessions or a Bind), from
        the side stream after the step's replay; the target's recv follows StepDone."""
        if self._side is None:  # gloo: the output is complete (the step ran on the host)
            self._sent = self.channel.send([self.output], bc.TARGET_RANK, 0)
            return
        with torch.cuda.stream(self._side):
            self._side.wait_event(self._done)
            self._sent = self.channel.send([self.output], bc.TARGET_RANK, 0)
