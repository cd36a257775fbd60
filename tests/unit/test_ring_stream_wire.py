"""drafter.wire.ring_stream alone over socket pairs: a striped body lands byte for byte as the
unstriped one does, each lane read by its own thread (Lanes) as its bytes come, and what a lane
says about its stripe is checked (receive_body) before the step may use the ring."""

from __future__ import annotations

import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from drafter.wire import ring_stream as rs


def _pairs(n: int) -> tuple[list[socket.socket], list[socket.socket]]:
    pairs = [socket.socketpair() for _ in range(n)]
    return [a for a, _ in pairs], [b for _, b in pairs]


def _receive(ours: list[socket.socket], size: int, wait_s: float = 10.0):
    """(ring, seq, pieces landed) of one message read as the drafter reads it."""
    ring = memoryview(bytearray(size))
    landed, lock = [], threading.Lock()

    def note(a: int, z: int) -> None:
        with lock:
            landed.append((a, z))
    stop = threading.Event()
    lanes = rs.Lanes(ours, ring, note, lambda: not stop.is_set(), 0.02).start() if len(ours) > 1 else None
    try:
        head_len, body_len, used = rs.read_prefix(ours[0], rs.MAX_HEAD, size, len(ours))
        assert rs.read_exact(ours[0], head_len) == b"head"
        seq = rs.receive_body(ours[0], ring, body_len, used, lanes, note, wait_s)
        return bytes(ring[:body_len]), seq, sorted(landed)
    finally:
        stop.set()
        if lanes is not None:
            lanes.join(5)


@pytest.mark.parametrize("lanes,lane_bytes", [(1, 0), (4, 0), (4, 3000), (8, 0)])
def test_a_striped_body_lands_as_the_unstriped_one(monkeypatch, lanes, lane_bytes):
    for name, value in (("CHUNK", 1024), ("ALIGN", 256), ("SEND_BYTES", 700), ("RECV_BYTES", 900)):
        monkeypatch.setattr(rs, name, value)
    body = os.urandom(10_000)
    theirs, ours = _pairs(lanes)
    spans = rs.plan(len(body), lanes, lane_bytes)
    assert len(spans) == {(1, 0): 1, (4, 0): 4, (4, 3000): 3, (8, 0): 8}[(lanes, lane_bytes)]
    with ThreadPoolExecutor(max(1, lanes - 1)) as pool:
        sender = threading.Thread(target=rs.send_striped, args=(theirs, b"head", len(body),
                                                                lambda a, z: body[a:z], pool, 7, lane_bytes))
        sender.start()
        got, seq, landed = _receive(ours, 16_384)
        sender.join(10)
    assert (got, seq) == (body, 7)
    assert landed[0][0] == 0 and landed[-1][1] == len(body) and all(x[1] == y[0] for x, y in zip(landed, landed[1:]))
    assert all(z - a <= 900 for a, z in landed), "each receive call at most RECV_BYTES"
    for s in theirs + ours:
        s.close()


def _lying(ours, theirs, records, used: int, size: int = 4096, body: int = 3000):
    """A message whose lane i sends LANE records[i] = (seq, start, length, bytes sent)."""
    theirs[0].sendall(rs.PREFIX.pack(4, body, used) + b"head")
    for conn, (seq, start, length, sent) in zip(theirs, records):
        conn.sendall(rs.LANE.pack(seq, start, length) + bytes(sent))
    return _receive(ours, size, wait_s=0.3)


@pytest.mark.parametrize("records,used,error", [
    ([(1, 0, 1500, 1500), (1, 1500, 1600, 1600)], 2, "lane"),  # past the body
    ([(1, 0, 1500, 1500), (1, 1400, 1600, 1600)], 2, "lane"),  # overlapping lane 0
    ([(1, 0, 1500, 1500), (1, 1600, 1400, 1400)], 2, "lane"),  # a gap
    ([(1, 0, 1500, 1500), (2, 1500, 1500, 1500)], 2, "lane"),  # another step
    ([(1, 0, 1500, 1500), (1, 1500, 5000, 0)], 2, "lane"),  # past the ring: refused before a byte is read
    ([(1, 100, 1500, 1500)], 2, "lane"),  # lane 0 not at the start
    ([(1, 0, 1500, 1500)], 2, "silent"),  # lane 1 sends nothing
])
def test_a_lane_that_lies_or_is_silent_is_named(records, used, error):
    theirs, ours = _pairs(2)
    try:
        with pytest.raises(rs.LaneLost if error == "silent" else rs.FrameError) as err:
            _lying(ours, theirs, records, used)
        if error != "silent":
            assert err.value.field == error
        else:
            assert err.value.lane == 1
    finally:
        for s in theirs + ours:
            s.close()


def test_a_lane_that_sends_a_stripe_its_message_does_not_have_is_named_at_the_next():
    """Message 1 on lane 0 alone, lane 1 sending a stripe anyway (it lands in the ring, inside it);
    message 2 on both lanes: lane 1's extra report is refused naming "lane"."""
    theirs, ours = _pairs(2)
    ring = memoryview(bytearray(4096))
    stop = threading.Event()
    lanes = rs.Lanes(ours, ring, None, lambda: not stop.is_set(), 0.02).start()
    try:
        theirs[0].sendall(rs.PREFIX.pack(4, 100, 1) + b"head" + rs.LANE.pack(1, 0, 100) + bytes(100))
        theirs[1].sendall(rs.LANE.pack(1, 100, 50) + bytes(50))
        head_len, body_len, used = rs.read_prefix(ours[0], rs.MAX_HEAD, 4096, 2)
        rs.read_exact(ours[0], head_len)
        assert rs.receive_body(ours[0], ring, body_len, used, lanes, None, 5.0) == 1
        theirs[0].sendall(rs.PREFIX.pack(4, 200, 2) + b"head" + rs.LANE.pack(2, 0, 100) + bytes(100))
        theirs[1].sendall(rs.LANE.pack(2, 100, 100) + bytes(100))
        head_len, body_len, used = rs.read_prefix(ours[0], rs.MAX_HEAD, 4096, 2)
        rs.read_exact(ours[0], head_len)
        with pytest.raises(rs.FrameError) as err:
            rs.receive_body(ours[0], ring, body_len, used, lanes, None, 5.0)
        assert err.value.field == "lane"
    finally:
        stop.set()
        lanes.join(5)
        for s in theirs + ours:
            s.close()


def test_a_lane_that_closes_fails_the_message():
    theirs, ours = _pairs(3)
    theirs[2].close()
    try:
        with pytest.raises(rs.LaneLost) as err:
            _lying(ours, theirs, [(1, 0, 1000, 1000), (1, 1000, 1000, 1000)], 3)
        assert err.value.lane == 2
    finally:
        for s in theirs[:2] + ours:
            s.close()


def test_a_reply_is_read_whole_and_bytes_past_it_are_refused():
    a, b = socket.socketpair()
    try:
        rs.send_message(a, b"done", [b"\x01" * 24])
        buf = bytearray(rs.PREFIX.size + rs.MAX_HEAD + 24)
        head, body = rs.read_reply(b, buf, 24)
        assert (bytes(head), bytes(body)) == (b"done", b"\x01" * 24)
        rs.send_message(a, b"done", [b"\x01" * 24])
        a.sendall(b"more")
        with pytest.raises(rs.FrameError) as err:
            for _ in range(2):  # the extra bytes may come after the first receive call
                rs.read_reply(b, buf, 24)
        assert err.value.field in ("reply", "header")
    finally:
        a.close()
        b.close()
    a, b = socket.socketpair()
    try:
        rs.send_message(a, b"done", [b"\x01" * 25])
        with pytest.raises(rs.FrameError) as err:
            rs.read_reply(b, bytearray(rs.PREFIX.size + rs.MAX_HEAD + 25), 24)
        assert err.value.field == "nbytes", "a body past what the caller takes is refused before it is read"
    finally:
        a.close()
        b.close()
