"""Multipart send and receive straight on pyzmq's Cython socket methods.

pyzmq's Python layer (zmq.sugar) spends a few microseconds per frame on keyword handling and
flag enums (IntFlag.__or__ per frame); a propose call has a dozen frames each way, on both
sides.  These helpers make the same libzmq calls with plain int flags.  Semantics are those of
send_multipart(copy=False) / recv_multipart(copy=False): frames below the socket's
copy_threshold are copied, larger ones are sent zero-copy (the caller keeps the buffer unchanged
until libzmq is done, as with any zero-copy send); a multipart message is atomic, so once its
first frame is accepted (or received) the others are too.
"""

from __future__ import annotations

import zmq

_SOCKET = zmq.backend.Socket
_SEND, _RECV = _SOCKET.send, _SOCKET.recv
SNDMORE, RCVMORE, NOBLOCK = int(zmq.SNDMORE), int(zmq.RCVMORE), int(zmq.NOBLOCK)


def send_frames(sock: zmq.Socket, frames: list, flags: int = 0) -> None:
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _SEND(sock, frame, flags | SNDMORE if i < last else flags, False, False)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list:
    """The next message's frames (zmq.Frame each, no copy)."""
    parts = [_RECV(sock, flags, False, False)]
    while parts[-1].more:  # read from the frame: a getsockopt(RCVMORE) costs ~15x more in pyzmq
        parts.append(_RECV(sock, flags, False, False))
    return parts


def recv_frames_capped(sock: zmq.Socket, flags: int, max_frames: int, max_bytes: int) -> tuple[list, str]:
    """The next message's frames, keeping at most `max_frames` frames and `max_bytes` bytes (after the
    first frame, the ROUTER identity).  Frames are taken one at a time; once a cap is crossed, the first
    three frames (identity, delimiter or envelope, envelope) are kept for the reply, the rest of the
    message is received and released frame by frame, and the second value says which cap was crossed
    ("" when none).  libzmq delivers a multipart message only once all of it has arrived, so its own
    buffer still holds the message until these reads release it; the per-frame size limit is the
    socket's MAXMSGSIZE."""
    frame = _RECV(sock, flags, False, False)
    parts = [frame]
    total, over = 0, ""
    while frame.more:  # set by the receive; a getsockopt(RCVMORE) costs ~1.5 us per frame in pyzmq
        frame = _RECV(sock, flags, False, False)
        if over:
            continue  # dropped: the frame is released as soon as the next one replaces it
        total += len(frame)
        if len(parts) >= max_frames:
            over = f"more than {max_frames} frames"
        elif total > max_bytes:
            over = f"more than {max_bytes} bytes"
        else:
            parts.append(frame)
            continue
        del parts[3:]
    return parts, over
