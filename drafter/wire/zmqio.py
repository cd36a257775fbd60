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
_SEND, _RECV, _GET = _SOCKET.send, _SOCKET.recv, _SOCKET.get
SNDMORE, RCVMORE, NOBLOCK = int(zmq.SNDMORE), int(zmq.RCVMORE), int(zmq.NOBLOCK)


def send_frames(sock: zmq.Socket, frames: list, flags: int = 0) -> None:
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _SEND(sock, frame, flags | SNDMORE if i < last else flags, False, False)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list:
    """The next message's frames (zmq.Frame each, no copy)."""
    parts = [_RECV(sock, flags, False, False)]
    while _GET(sock, RCVMORE):
        parts.append(_RECV(sock, flags, False, False))
    return parts
