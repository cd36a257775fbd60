"""An oversized ZMQ message can be released a slice at a time (issue 19, the soak's 2x goal): the receive
that refuses it stops after `drop_most` dropped frames and says frames are left; drop_frames releases the
rest in slices; the next message then arrives whole."""

from __future__ import annotations

import zmq

from drafter.wire.zmqio import drop_frames, recv_frames_bounded


def test_an_oversized_message_is_released_in_slices():
    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send_multipart([b"env"] + [b"x"] * 1000)
        client.send_multipart([b"env", b"body"])
        assert server.poll(10_000)
        frames, over, left = recv_frames_bounded(server, 0, 8, 1 << 20, 100)
        assert (over, left, len(frames)) == ("more than 8 frames", True, 3)
        slices = 1
        while not drop_frames(server, zmq.NOBLOCK, 100):
            slices += 1
        assert slices == 9  # 1001 frames: 8 kept or looked at, 100 dropped per call
        assert server.poll(10_000)
        frames, over, left = recv_frames_bounded(server, 0, 8, 1 << 20, 100)
        assert (over, left) == ("", False) and [f.bytes for f in frames[1:]] == [b"env", b"body"]
    finally:
        ctx.destroy(linger=0)
