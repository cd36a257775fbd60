"""Frames per message and bytes per message are capped while receiving (issue 19, item 2): an oversized
multipart message is not collected into one list; the receiver keeps only the frames it needs to answer,
releases the rest frame by frame, and the next message arrives intact."""

from __future__ import annotations

import zmq

from drafter.wire.zmqio import recv_frames_capped


def _pair():
    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (server, client):
        s.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client.connect(f"tcp://127.0.0.1:{port}")
    return ctx, server, client


def _recv(server, max_frames, max_bytes):
    assert server.poll(10_000)
    return recv_frames_capped(server, 0, max_frames, max_bytes)


def test_too_many_frames_are_dropped_while_receiving():
    ctx, server, client = _pair()
    try:
        client.send_multipart([b"env"] + [b"x"] * 10_000)
        client.send_multipart([b"env", b"body", b"t"])
        frames, over = _recv(server, 8, 1 << 20)
        assert over == "more than 8 frames"
        assert len(frames) == 3 and frames[1].bytes == b"env"
        frames, over = _recv(server, 8, 1 << 20)
        assert over == "" and [f.bytes for f in frames[1:]] == [b"env", b"body", b"t"]
    finally:
        ctx.destroy(linger=0)


def test_too_many_bytes_are_dropped_while_receiving():
    ctx, server, client = _pair()
    try:
        client.send_multipart([b"env", b"h"] + [b"y" * 4096] * 64)  # 256 KiB against a 64 KiB cap
        frames, over = _recv(server, 1000, 64 * 1024)
        assert over == f"more than {64 * 1024} bytes"
        assert sum(len(f) for f in frames[1:]) <= 64 * 1024 and len(frames) == 3
    finally:
        ctx.destroy(linger=0)
