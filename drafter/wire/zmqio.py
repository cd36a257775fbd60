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
    first frame, the ROUTER identity); the second value says which cap was crossed ("" when none).  The
    rest of an oversized message is received and released here (recv_frames_bounded with no drop limit)."""
    parts, over, _ = recv_frames_bounded(sock, flags, max_frames, max_bytes, None)
    return parts, over


def recv_frames_bounded(sock: zmq.Socket, flags: int, max_frames: int, max_bytes: int,
                        drop_most: int | None) -> tuple[list, str, bool]:
    """recv_frames_capped that releases at most `drop_most` frames of an oversized message (None: all of
    them); the third value is True when frames of it are left (drop them with drop_frames before the next
    message), so a caller on an event loop can answer the message and give other work a turn first.

    Frames are taken one at a time; once a cap is crossed, the first three frames (identity, delimiter or
    envelope, envelope) are kept for the reply and the rest is received and released frame by frame,
    never collected.  libzmq delivers a multipart message only once all of it has arrived, so its own
    buffer still holds the message until these reads release it; the per-frame size limit is the
    socket's MAXMSGSIZE."""
    frame = _RECV(sock, flags, False, False)
    parts = [frame]
    total, over = 0, ""
    while frame.more:  # set by the receive; a getsockopt(RCVMORE) costs ~1.5 us per frame in pyzmq
        frame = _RECV(sock, flags, False, False)
        total += len(frame)
        if len(parts) >= max_frames:
            over = f"more than {max_frames} frames"
        elif total > max_bytes:
            over = f"more than {max_bytes} bytes"
        else:
            parts.append(frame)
            continue
        del parts[3:]
        return parts, over, frame.more and not drop_frames(sock, flags, drop_most)
    return parts, over, False


def drop_frames(sock: zmq.Socket, flags: int, most: int | None) -> bool:
    """Receive and release the current message's remaining frames, at most `most` of them (None: all);
    True when its last frame was taken.  Call only while a message is partly received (its remaining
    frames have arrived with it, so NOBLOCK never finds none)."""
    n = 0
    while most is None or n < most:
        n += 1
        if not _RECV(sock, flags, False, False).more:
            return True
    return False
