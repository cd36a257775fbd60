"""A same-host doorbell for bound steps: one UNIX-domain SOCK_SEQPACKET connection per binding.

    drafter (Bind):       listener, address = listen()       # address -> BindResponse.doorbell
    drafter (its thread): conn = accept(listener, bind_id, alive, poll_s, hello_s)
                          frame = receive(conn, poll_s)      # a StepHeader; None: nothing yet; b"": closed
                          conn.send(encoded StepDone)
    target:               bell = connect(address, bind_id, timeout_s)
                          bell.send(encoded StepHeader); frame = receive(bell, left)

Why: a ZMQ message between two threads of two processes passes libzmq's I/O threads: the
sender's thread hands it to its I/O thread (one wake-up), which writes the socket; the peer's I/O
thread wakes (two), reads it and signals the receiving socket's mailbox, whose thread wakes
(three).  Here the sender's own thread writes the kernel socket and the receiver's thread, asleep
in poll on that socket, is the one woken: one wake-up per direction.  SEQPACKET keeps message
boundaries, so a frame is one record.

A target may ring first (WAKE, one byte) when it starts preparing a step (filling its buffers):
the drafter's thread wakes while the target works and polls for the header without sleeping again,
so the wake-up is paid in parallel with the target's fill rather than after the header was sent.

Addresses are Linux abstract names ("@drafter-bell-<24 hex>" on the wire: nothing on the file
system, gone with the socket).  Any process of the same network namespace could connect, so a
connection must first send the binding's hello (the bind id, a random 128-bit secret the Bind's
reply gave the binder alone); any other connection is closed unanswered, and the listener accepts
until one hello passed.  Where the target cannot reach the name (another host, another network
namespace) connect() raises and the caller keeps the binding's ZMQ data socket.  Neutral: stdlib only.
"""

from __future__ import annotations

import hmac
import re
import secrets
import socket
import sys
import time
from typing import Callable

PREFIX = "@drafter-bell-"
_ADDRESS = re.compile(r"@drafter-bell-[0-9a-f]{24}")
MAX_FRAME = 1 << 16  # bytes: a StepHeader (sizes, a bind id, up to max_num_seqs accepted counts) or a StepDone
HELLO = b"drafter-bell hello "
OK = b"drafter-bell ok"


WAKE = b"\xc1"  # a frame no record encodes to (0xc1 is never used by msgpack): "my header comes soon"


class FrameTooLong(ValueError):
    """A frame longer than MAX_FRAME (cut by the kernel): the peer does not speak this protocol."""


def available() -> bool:
    """Abstract UNIX-domain names are Linux's."""
    return sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")


def check_address(address: str) -> str:
    """The kernel's name for a wire address; ValueError for anything but a doorbell's."""
    if not _ADDRESS.fullmatch(address):
        raise ValueError(f"not a doorbell address: {address[:80]!r}")
    return "\0" + address[1:]


def listen() -> tuple[socket.socket, str]:
    """A listening SEQPACKET socket under a fresh random abstract name; (socket, wire address).
    OSError where the platform has none."""
    address = PREFIX + secrets.token_hex(12)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(check_address(address))
        sock.listen(4)
    except OSError:
        sock.close()
        raise
    return sock, address


def receive(sock: socket.socket, timeout_s: float | None) -> bytes | None:
    """One frame; None when none came within timeout_s (None: keep the socket's timeout); b"" when
    the peer closed (frames are never empty).  FrameTooLong for a frame past MAX_FRAME."""
    if timeout_s is not None:
        sock.settimeout(max(timeout_s, 1e-6))
    try:
        data, _, flags, _ = sock.recvmsg(MAX_FRAME)
    except TimeoutError:
        return None
    if flags & socket.MSG_TRUNC:
        raise FrameTooLong(f"a frame over {MAX_FRAME} bytes")
    return data


def spin(sock: socket.socket, seconds: float, buf: bytearray) -> bytes | None:
    """Poll the socket without sleeping for up to `seconds` (a thread that sleeps pays a wake-up
    when the next frame comes, and runs cold after it); the frame, b"" when the peer closed, None
    when nothing came.  buf: MAX_FRAME bytes of scratch.  The socket's timeout is kept."""
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        end = time.perf_counter() + seconds
        while True:
            try:
                n, _, flags, _ = sock.recvmsg_into([buf])
            except BlockingIOError:
                if time.perf_counter() >= end:
                    return None
                continue
            if flags & socket.MSG_TRUNC:
                raise FrameTooLong(f"a frame over {MAX_FRAME} bytes")
            return bytes(buf[:n])
    finally:
        sock.settimeout(timeout)


def accept(listener: socket.socket, token: str, alive: Callable[[], bool], poll_s: float,
           hello_s: float) -> socket.socket | None:
    """The first connection that sends the hello for `token` within hello_s (each other one is
    closed); None once alive() turns False or the listener fails.  Looks at alive() every poll_s."""
    listener.settimeout(poll_s)
    while alive():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            return None
        if _greeted(conn, token, hello_s):
            return conn
        conn.close()
    return None


def _greeted(conn: socket.socket, token: str, hello_s: float) -> bool:
    try:
        frame = receive(conn, hello_s)
        if frame is None or not hmac.compare_digest(frame, HELLO + token.encode()):
            return False
        conn.send(OK)
        return True
    except (OSError, ValueError):
        return False


def connect(address: str, token: str, timeout_s: float) -> socket.socket:
    """A connection to the drafter's doorbell, its hello accepted within timeout_s.  OSError (or
    ValueError for an address that is not a doorbell's) when it cannot be made: use the data socket."""
    name = check_address(address)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(timeout_s)
        sock.connect(name)
        sock.send(HELLO + token.encode())
        if receive(sock, timeout_s) != OK:
            raise ConnectionRefusedError("the drafter did not accept the doorbell's hello")
    except BaseException:
        sock.close()
        raise
    return sock
