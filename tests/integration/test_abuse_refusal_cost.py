"""What refused ZMQ traffic costs the server's event loop (issue 19, the soak's 2x goal): a refusal and an
Info are answered in the reader callback without creating an asyncio task, and an oversized message is
released in slices, the socket's lock let go between them, for up to a time budget per turn of the loop
(the loop's other work running between turns), and refused once its last frame is released.

In-process (a ServiceCore and a ZmqServer on this test's event loop, the client in a worker thread), so
the tasks the loop creates can be counted.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch
import zmq

from drafter.service import zmq_server
from drafter.wire import schema
from drafter.wire.errors import Code
from tests.support.core import run_with_core
from tests.support.engines import build_engine

_ENC = msgspec.msgpack.Encoder()


@pytest.fixture(scope="module")
def engine(tiny_root):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_engine(tiny_root, "eagle3", k=3, max_model_len=96, num_blocks=48)
    torch.set_num_threads(threads)


class _CountingLoop:
    """The running loop, with the tasks created through it counted."""

    def __init__(self, loop):
        self._loop, self.tasks = loop, 0

    def create_task(self, coro, **kw):
        self.tasks += 1
        return self._loop.create_task(coro, **kw)

    def __getattr__(self, name):
        return getattr(self._loop, name)


def _exchange(endpoint: str, messages: list[list[bytes]]) -> list[schema.Envelope]:
    """Send each message on one DEALER and read one reply per message (in order of arrival)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        for m in messages:
            sock.send_multipart(m)
        out = []
        for _ in messages:
            assert sock.poll(30_000), "every message gets a reply"
            out.append(msgspec.msgpack.decode(sock.recv_multipart()[0], type=schema.Envelope))
        return out
    finally:
        ctx.destroy(linger=0)


def _serve(engine, body, **settings):
    async def run(core):
        server = zmq_server.ZmqServer(core, host="127.0.0.1", port=0, max_message_bytes=1 << 20, **settings)
        server.start()
        server._loop = counting = _CountingLoop(server._loop)
        try:
            return await body(asyncio.get_running_loop(), server, counting)
        finally:
            await server.close()
    run_with_core(engine, run)


def test_refusals_and_info_create_no_task(engine):
    bad_utf8 = _ENC.encode(schema.AttachRequest(client_name="QQQQ")).replace(b"QQQQ", b"\xff\xfe\xfd\xfc")
    messages = [[_ENC.encode(schema.Envelope(call_id=1, method="Attach")), bad_utf8],
                [_ENC.encode(schema.Envelope(call_id=2, method="Info")), _ENC.encode({"made_up": 1})],
                [_ENC.encode(schema.Envelope(call_id=3, method="NoSuchMethod")), b""],
                [_ENC.encode(schema.Envelope(call_id=4, method="Detach")), b"", b"tensor"],
                [_ENC.encode(schema.Envelope(call_id=5, method="Info")), b""]]

    async def body(loop, server, counting):
        got = await loop.run_in_executor(None, _exchange, f"tcp://127.0.0.1:{server.port}", messages)
        by_id = {e.call_id: e for e in got}
        assert (Code(by_id[1].error.code), by_id[1].error.field) == (Code.INVALID_ARGUMENT, "client_name")
        assert (Code(by_id[2].error.code), by_id[2].error.field) == (Code.INVALID_ARGUMENT, "made_up")
        assert (Code(by_id[3].error.code), by_id[3].error.field) == (Code.INVALID_ARGUMENT, "method")
        assert (Code(by_id[4].error.code), by_id[4].error.field) == (Code.INVALID_ARGUMENT, "frames")
        assert by_id[5].error is None
        assert counting.tasks == 0, "a refusal or an Info must not cost an asyncio task"
        requests = server.core.metrics.requests
        assert requests.labels("zmq", "Info", "INVALID_ARGUMENT")._value.get() == 1
        assert requests.labels("zmq", "Info", "OK")._value.get() == 1
        assert requests.labels("zmq", "unknown", "INVALID_ARGUMENT")._value.get() == 1
    _serve(engine, body)


def test_oversized_message_is_released_a_slice_per_turn(engine, monkeypatch):
    slices = []  # the loop's callbacks that ran between two slices of the drop
    ran = []
    drop = zmq_server.drop_frames

    def counted(sock, flags, most):
        slices.append(len(ran))
        return drop(sock, flags, most)
    monkeypatch.setattr(zmq_server, "drop_frames", counted)
    frames = 20 * zmq_server.DROP_BURST

    async def body(loop, server, counting):
        def tick():  # another piece of the loop's work, due every turn while the drop goes on
            ran.append(1)
            # every turn until the exchange is answered (its poll ends it within 30 s), not a count of
            # turns: a starved box spun up to ~5,800 turns before the drop began, and a count used up
            # before then leaves no tick between the slices
            if not done.done():
                loop.call_soon(tick)
        done = loop.run_in_executor(None, _exchange, f"tcp://127.0.0.1:{server.port}",
                                    [[_ENC.encode(schema.Envelope(call_id=1, method="Propose")), b""]
                                     + [b"z"] * frames,
                                     [_ENC.encode(schema.Envelope(call_id=2, method="Info")), b""]])
        loop.call_soon(tick)
        got = await done
        assert (Code(got[0].error.code), got[0].error.field) == (Code.INVALID_ARGUMENT, "frames")
        assert got[1].call_id == 2 and got[1].error is None  # the next message arrives whole
    _serve(engine, body, drop_budget_s=0.0)  # no budget: one slice a turn
    assert len(slices) >= 10, f"the drop was not sliced: {len(slices)} slices"
    assert slices[-1] > slices[0], "the loop's other work did not run between slices"


def test_drop_goes_on_within_its_budget(engine, monkeypatch):
    """Within drop_budget_s one turn releases slice after slice (the socket's lock let go between them), so
    the socket's other peers, whose messages ZMQ delivers only after the drop, wait for few turns."""
    slices = []
    ran = []
    drop = zmq_server.drop_frames

    def counted(sock, flags, most):
        slices.append(len(ran))
        return drop(sock, flags, most)
    monkeypatch.setattr(zmq_server, "drop_frames", counted)
    frames = 20 * zmq_server.DROP_BURST

    async def body(loop, server, counting):
        def tick():
            ran.append(1)
            if not done.done():  # every turn until the exchange is answered (as above)
                loop.call_soon(tick)
        done = loop.run_in_executor(None, _exchange, f"tcp://127.0.0.1:{server.port}",
                                    [[_ENC.encode(schema.Envelope(call_id=1, method="Propose")), b""]
                                     + [b"z"] * frames,
                                     [_ENC.encode(schema.Envelope(call_id=2, method="Info")), b""]])
        loop.call_soon(tick)
        got = await done
        assert (Code(got[0].error.code), got[0].error.field) == (Code.INVALID_ARGUMENT, "frames")
        assert got[1].call_id == 2 and got[1].error is None
    _serve(engine, body, drop_budget_s=60.0)  # a budget no drop of these frames reaches
    assert len(slices) >= 10, f"the drop was not sliced: {len(slices)} slices"
    assert len(set(slices)) == 1, "the drop left the turn before its budget was spent"


def test_drop_burst_sets_the_slice(engine, monkeypatch):
    """drop_burst (serve's hidden --zmq-drop-burst, the probe's A/B) is how many frames one turn releases."""
    mosts = []
    drop = zmq_server.drop_frames

    def counted(sock, flags, most):
        mosts.append(most)
        return drop(sock, flags, most)
    monkeypatch.setattr(zmq_server, "drop_frames", counted)
    burst = 1000

    async def body(loop, server, counting):
        got = await loop.run_in_executor(None, _exchange, f"tcp://127.0.0.1:{server.port}",
                                         [[_ENC.encode(schema.Envelope(call_id=1, method="Propose")), b""]
                                          + [b"z"] * (4 * burst)])
        assert (Code(got[0].error.code), got[0].error.field) == (Code.INVALID_ARGUMENT, "frames")
    _serve(engine, body, drop_burst=burst)
    assert mosts and set(mosts) == {burst} and len(mosts) <= 4, mosts


def test_oversized_message_is_refused_after_its_last_frame(engine, monkeypatch):
    """The refusal leaves once the whole message is consumed, as before the drop was sliced: a sender that
    waits for it (the abuse soak's frames attacker) cannot queue its next oversized message during the drop,
    which the socket's other peers wait for."""
    events = []
    drop = zmq_server.drop_frames
    send_error = zmq_server.ZmqServer._send_error

    def counted(sock, flags, most):
        done = drop(sock, flags, most)
        events.append("last" if done else "slice")
        return done

    def recorded(self, ep, head, env, exc):
        events.append("refused")
        return send_error(self, ep, head, env, exc)
    monkeypatch.setattr(zmq_server, "drop_frames", counted)
    monkeypatch.setattr(zmq_server.ZmqServer, "_send_error", recorded)

    async def body(loop, server, counting):
        got = await loop.run_in_executor(None, _exchange, f"tcp://127.0.0.1:{server.port}",
                                         [[_ENC.encode(schema.Envelope(call_id=1, method="Propose")), b""]
                                          + [b"z"] * (10 * zmq_server.DROP_BURST)])
        assert (Code(got[0].error.code), got[0].error.field) == (Code.INVALID_ARGUMENT, "frames")
    _serve(engine, body, drop_budget_s=0.0)
    assert events.count("refused") == 1 and events[-2:] == ["last", "refused"], events
