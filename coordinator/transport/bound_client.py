"""A target's persistent buffers bound to a remote drafter over the host ring (ZMQ) or a gloo channel.

    client = HostRingClient("tcp://127.0.0.1:5555", layout, buffers, max_batch=8)
    bufs = client.views                    # the target's persistent buffers: views into one slab
    ...                                    # every step the target fills their first rows
    drafts = client.step(num_tokens, batch)   # [batch, k] int64

The buffers are described to the drafter once (drafter.wire.bound.BindRequest); both ends lay
them out identically in one contiguous slab, so a step sends a StepHeader and the slab's used
prefix as one zero-copy frame, which the drafter receives straight into its own ring.  No
per-tensor work on either side.  On a GPU target the slab is pinned and filled by one
device-to-host copy per step (not built here: the target's buffers are CPU views).  With
plane="gloo_channel" the prefix goes by a point-to-point send on a two-rank gloo process group
instead of the second frame (drafter.wire.bound).

Fails closed as the other clients do: every step has a deadline and raises DrafterError on a
refusal, a timeout or a lost drafter; it never returns drafts it did not receive.  After a
drafter restart (a data socket that no longer connects, a timeout, an unknown session or a stale
epoch) the binding is dropped and the client attaches and binds again by itself; the step that
binds again is refused with FAILED_PRECONDITION (the new binding's KV is empty: resend the
context), the next one drafts.
"""

from __future__ import annotations

import itertools
import time

import msgspec
import torch
import zmq

from drafter.wire import bound as wb
from drafter.wire import schema
from drafter.wire.errors import Code, DrafterError
from drafter.wire.tensors import DTYPES

_ENVELOPE = msgspec.msgpack.Decoder(schema.Envelope)
_ATTACH = msgspec.msgpack.Decoder(schema.AttachResponse)
_REBIND = (Code.NOT_FOUND, Code.FAILED_PRECONDITION)  # the drafter forgot the session: attach again


class HostRingClient:
    def __init__(self, endpoint: str, layout: schema.AttachRequest, buffers: list[wb.BufferSpec], *,
                 max_batch: int, transport: str = "tcp", plane: str = wb.HOST_RING, timeout_s: float = 5.0):
        self.endpoint, self.layout, self.buffers, self.plane = endpoint, layout, list(buffers), plane
        self.max_batch, self.transport, self.timeout_s = max_batch, transport, timeout_s
        self.slots, total = wb.ring_layout(self.buffers, lambda d: DTYPES[d].itemsize)
        self.slab = torch.zeros(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self._bytes = memoryview(self.slab.numpy())
        self.views = {s.name: self.slab[s.offset:s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape)
                      for s in self.slots}
        self.ctx = zmq.Context()
        self.control = self._socket(endpoint, immediate=False)
        self.data: zmq.Socket | None = None
        self.channel = None  # gloo_channel: the two-rank process group (this side rank 0)
        self.session: schema.AttachResponse | None = None
        self.width = 0
        self.binds = 0  # how many times this client bound (a restart shows as one more)
        self._calls = itertools.count(1)
        self._steps = itertools.count(1)

    # ------------------------------------------------------------------ control
    def _socket(self, endpoint: str, immediate: bool) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if immediate:  # queue only on a live connection: a step to a gone drafter fails at once
            sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(endpoint)
        return sock

    def _call(self, method: str, body, decoder, deadline: float):
        """One control request and its reply (stale replies of earlier calls are skipped)."""
        call_id = next(self._calls)
        self.control.send_multipart([wb.encode(schema.Envelope(call_id=call_id, method=method)), wb.encode(body)])
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.control.poll(int(left * 1000) + 1):
                raise DrafterError(Code.DEADLINE_EXCEEDED, "", f"{method}: no reply in {self.timeout_s} s")
            frames = self.control.recv_multipart()
            env = _ENVELOPE.decode(frames[0])
            if env.call_id != call_id:
                continue
            if env.error is not None:
                raise DrafterError(Code(env.error.code), env.error.field, env.error.message)
            return decoder.decode(frames[1])

    def bind(self) -> wb.BindResponse:
        """Attach, register the buffers and connect the session's data socket."""
        self.unbind()
        deadline = time.monotonic() + self.timeout_s
        self.session = self._call("Attach", self.layout, _ATTACH, deadline)
        resp = self._call(wb.BIND_METHOD, wb.BindRequest(
            session_id=self.session.session_id, epoch=self.session.epoch, transport=self.transport, plane=self.plane,
            buffers=self.buffers, max_batch=self.max_batch), wb.BIND_RESPONSE_DECODER, deadline)
        self.width = resp.drafts_width
        self.data = self._socket(resp.endpoint, immediate=True)
        left = deadline - time.monotonic()
        if left <= 0 or not self.data.poll(int(left * 1000) + 1, zmq.POLLOUT):  # connected (IMMEDIATE)
            self.unbind()
            raise DrafterError(Code.DEADLINE_EXCEEDED, "", f"the data socket {resp.endpoint} did not connect")
        if self.plane == wb.GLOO_CHANNEL:
            self.channel = _join_channel(resp, self.timeout_s)  # also each step's send timeout
        self.binds += 1
        return resp

    def unbind(self) -> None:
        """Forget the binding (the drafter's side ends with its session)."""
        if self.data is not None:
            self.data.close(linger=0)
        self.data, self.session, self.channel = None, None, None

    def close(self) -> None:
        """Close the sockets and the context (call it: a context left to the garbage collector
        can block in term() inside whatever code the collector interrupts)."""
        if self.control.closed:
            return
        self.unbind()
        self.control.close(linger=0)
        self.ctx.term()

    # ------------------------------------------------------------------ steps
    def step(self, num_tokens: int, batch: int, batch_padded: int = 0, tokens_padded: int = 0) -> torch.Tensor:
        """Draft for the rows the target wrote into the views' first num_tokens / batch rows;
        [batch, width] int64 (a new tensor: the slab may be refilled at once)."""
        if self.data is None:
            self._bind_in_step()
        nbytes = wb.step_bytes(self.slots, num_tokens)
        if not 0 <= nbytes <= len(self._bytes):
            raise DrafterError(Code.INVALID_ARGUMENT, "num_tokens", f"{num_tokens} tokens exceed the bound buffers")
        step = next(self._steps)
        head = wb.StepHeader(step=step, num_tokens=num_tokens, batch=batch, batch_padded=batch_padded,
                             tokens_padded=tokens_padded, nbytes=nbytes)
        try:
            self._send(head)
        except zmq.Again:  # no live connection: the drafter went away (a restart): bind again
            self.unbind()
            self._bind_in_step()
        return self._reply(step, batch)

    def _bind_in_step(self) -> None:
        """Bind; after the first binding, a new one means the drafter's KV for this target is
        empty (a restart, a forgotten session): the step is refused (FAILED_PRECONDITION), as
        RemoteProposer returns no drafts for a step during which its session changed, so the
        target resends the context before it drafts again under the new binding."""
        first = self.binds == 0
        self.bind()
        if not first:
            raise DrafterError(Code.FAILED_PRECONDITION, "session",
                               "bound again (the drafter restarted or forgot the session): resend the context")

    def _send(self, head: wb.StepHeader) -> None:
        """The header, and the ring's prefix as its second frame or down the gloo channel."""
        if self.channel is None:
            self.data.send_multipart([wb.encode(head), self._bytes[:head.nbytes]], flags=zmq.NOBLOCK, copy=False)
            return
        self.data.send(wb.encode(head), flags=zmq.NOBLOCK)
        try:
            self.channel.send([self.slab[:head.nbytes]], 1, 0).wait()
        except RuntimeError as exc:  # the peer went away or timed out: the channel is gone
            self.unbind()
            raise DrafterError(Code.UNAVAILABLE, "", f"the gloo channel failed: {exc}") from None

    def _reply(self, step: int, batch: int) -> torch.Tensor:
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.data.poll(int(left * 1000) + 1):
                self.unbind()  # the frame may still sit in a queue: the slab is no longer lent to it
                raise DrafterError(Code.DEADLINE_EXCEEDED, "", f"bound step {step}: no reply in {self.timeout_s} s")
            frames = self.data.recv_multipart(copy=False)
            done = wb.DONE_DECODER.decode(frames[0].buffer)
            if done.step != step:
                continue  # an answer to a step that already timed out
            if done.code:
                code = Code(done.code)
                if code in _REBIND:
                    self.unbind()
                raise DrafterError(code, done.field, done.message)
            drafts = torch.frombuffer(bytearray(frames[1].buffer), dtype=torch.int64)
            return drafts.view(batch, self.width)


def _join_channel(resp: wb.BindResponse, timeout_s: float):
    """This side (rank 0) of the binding's two-rank gloo group, on the drafter's TCPStore."""
    import datetime

    import torch.distributed as dist

    host, port = resp.store.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host.strip("[]"), int(port), 2, False, timeout=timeout)
        return dist.ProcessGroupGloo(dist.PrefixStore(resp.channel, store), 0, 2, timeout)
    except RuntimeError as exc:
        raise DrafterError(Code.UNAVAILABLE, "store", f"joining the gloo channel at {resp.store}: {exc}") from None
