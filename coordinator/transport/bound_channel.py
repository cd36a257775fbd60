"""The target's end of an nccl_channel binding: its GPU slab to the drafter's GPU over NCCL.

    link = ChannelLink(ctx, device, resp, max_batch, groups, slab, slots, via=endpoint)
    link.connect(timeout_s, channel_timeout_s)    # the data socket, then the NCCL group joined (rank 0)
    drafts = link.step_async(num_tokens, batch, 0, 0, timeout_s)   # [batch, width] on this GPU
    link.raise_for(link.error_word())              # INVALID_ARGUMENT naming what the drafter's guard masked

One step: the slab's used prefix (drafter.wire.bound.step_bytes: every small buffer whole, the first
num_tokens rows of the hidden states) goes by one send, queued on NCCL's stream after the current
stream's writes into the slab; then the StepHeader on the data socket; the drafter's StepDone; a
StepDone with code 0 means the drafter queued its output's send, and only then this side posts the
recv of the whole output (drafts, then the error word: drafter.wire.bound.output_words) into its own
output buffer, so a refused step leaves both ends' operations paired.  The current stream waits on
the send before the slab may be refilled and on the recv before the drafts are read: no host sync.
Host reads (read_back, error_word) first poll the recv's completion against the step's deadline,
so a drafter gone after its StepDone fails the step (DEADLINE_EXCEEDED) instead of hanging it.

The group's backend is NCCL (BACKEND; the CPU tests put gloo here and run the same link on host
tensors).  Joining runs on a helper thread bounded by channel_timeout_s: NCCL's communicator set-up
blocks until both ranks joined, and a drafter that never joins must not hang the caller (the
helper thread is then left behind, blocked).
"""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist
import zmq

from coordinator.transport.bound_ipc import DeviceLink
from drafter.wire import bound as wb
from drafter.wire import bound_channel as bc
from drafter.wire.errors import Code, DrafterError

BACKEND = bc.NCCL  # the tests put bc.GLOO here (host tensors)
REFUSED = ("plane", "device_uuid", "store")  # a drafter that cannot serve the plane: the host ring instead


class ChannelLink(DeviceLink):
    """One nccl_channel binding's data path (the RemoteProposer's BoundTransport and
    CudaIpcBoundClient alike): the slab sent by NCCL, header-only steps, the output received by NCCL."""

    plane = wb.NCCL_CHANNEL

    def __init__(self, ctx: zmq.Context, device: torch.device, resp: wb.BindResponse, max_batch: int, groups: int,
                 slab: torch.Tensor, slots: list[wb.Slot], via: str = ""):
        """slab: [ring bytes] uint8 on `device` in the layout `slots` (the buffers the Bind named)."""
        self.slab, self.slots = slab, slots
        width = resp.drafts_width
        self._output = torch.zeros(wb.output_words(max_batch, width), dtype=torch.int64, device=device)  # [words]
        self.output = self._output[:max_batch * width + 1]  # [max_batch * width + 1]: drafts..., error word
        self.channel = None
        self._sent = self._arrived = None  # this step's send of the slab, recv of the output
        self._deadline = 0.0  # time.monotonic() by which the output must have arrived
        self._settled = True  # whether this step's recv was seen done on the host
        self._setup(ctx, device, resp, groups, via)

    def connect(self, timeout_s: float, channel_timeout_s: float = 5.0) -> bool:
        """The data socket connected (at most timeout_s; False if not), then the group joined and the
        handshake sent (at most channel_timeout_s; DrafterError UNAVAILABLE "store" if not)."""
        if not super().connect(timeout_s):
            return False
        if self.channel is None:
            self.channel = join(self.resp, self.device, channel_timeout_s, inputs=self.slab, output=self._output)
        return True

    def close(self) -> None:
        super().close()
        group, self.channel = self.channel, None
        bc.close_group(group)

    # ------------------------------------------------------------------ the step's hooks (DeviceLink.exchange)
    def _nbytes(self, num_tokens: int) -> int:
        nbytes = wb.step_bytes(self.slots, num_tokens)
        if not 0 < nbytes <= self.slab.numel():
            raise DrafterError(Code.INVALID_ARGUMENT, "num_tokens", f"{num_tokens} tokens exceed the bound buffers")
        return nbytes

    def _before_send(self, head: wb.StepHeader) -> None:
        """The slab's prefix sent (NCCL's stream waits for the current stream's writes first)."""
        if self.channel is None:
            raise DrafterError(Code.UNAVAILABLE, "data", "the channel is closed")
        try:
            self._sent = self.channel.send([self.slab[:head.nbytes]], bc.DRAFTER_RANK, 0)
        except RuntimeError as exc:
            self.close()
            raise DrafterError(Code.UNAVAILABLE, "", f"the nccl channel failed: {exc}") from None

    def _reply(self, step: int, timeout_s: float) -> wb.StepDone:
        try:
            return super()._reply(step, timeout_s)
        finally:
            if self.alive and self._sent is not None:  # refused or not: the slab is refilled after the send
                self._sent.wait()  # GPU: the current stream waits; gloo: done (the drafter replied after its recv)

    def _after_reply(self, timeout_s: float) -> None:
        """The drafter queued its output's send: post the recv into this side's output."""
        self._deadline = time.monotonic() + timeout_s
        self._arrived = self.channel.recv([self._output], bc.DRAFTER_RANK, 0)
        self._settled = False

    def _arrive(self) -> None:
        if self.device.type != "cuda":
            self._settle()  # gloo: the host waits (bounded by the step's deadline)
        else:
            self._arrived.wait()  # the current stream waits for the recv, no host sync

    def _settle(self) -> None:
        """The output's recv done on the host's clock, within the step's deadline (else the link is
        closed: DEADLINE_EXCEEDED).  Once per step (a gloo work is waited for once only)."""
        if self._settled:
            return
        try:
            bc.settle(self._arrived, self._deadline, "the drafts' transfer", self.device.type == "cuda")
            if self.device.type == "cuda":
                self._arrived.wait()  # done: raises where the transfer failed (an aborted communicator)
        except (TimeoutError, RuntimeError) as exc:
            self.close()
            raise DrafterError(Code.DEADLINE_EXCEEDED, "", str(exc)) from None
        self._settled = True

    def read_back(self) -> torch.Tensor:
        self._settle()
        return super().read_back()

    def error_word(self) -> int:
        self._settle()
        return super().error_word()


def join(resp: wb.BindResponse, device: torch.device, timeout_s: float, inputs: torch.Tensor | None = None,
         output: torch.Tensor | None = None):
    """This side (rank 0) of the binding's group on the drafter's TCPStore, the handshake made (a
    word each way, then inputs, [ring bytes] uint8, and output, [output words] int64, each way at full
    size: drafter.wire.bound_channel.handshake); on a helper thread bounded by timeout_s.
    DrafterError UNAVAILABLE "store" when it fails or is late."""
    got: dict = {}
    td = datetime.timedelta(seconds=timeout_s)

    def run() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            host, port = resp.store.rsplit(":", 1)
            store = dist.TCPStore(host.strip("[]"), int(port), 2, False, timeout=td)
            group = bc.open_group(BACKEND, store, resp.channel, bc.TARGET_RANK, td)
            bc.handshake(group, bc.TARGET_RANK, device, time.monotonic() + timeout_s, inputs=inputs, output=output)
            got["group"] = group
        except Exception as exc:  # noqa: BLE001 - whatever torch raises, the caller gets it, not a dead thread
            got["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run, name="nccl-channel-join", daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)
    if "group" not in got:
        why = got.get("error", f"no answer in {timeout_s} s")
        raise DrafterError(Code.UNAVAILABLE, "store", f"joining the {BACKEND} channel at {resp.store}: {why}")
    return got["group"]
