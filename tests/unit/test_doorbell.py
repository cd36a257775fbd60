"""The bound steps' same-host doorbell (drafter.wire.doorbell): who may ring it, and its frames.

A connection is accepted only with the binding's hello (the bind id); a stranger's, or a silent
one, is closed and the right target still gets in; an address that is not a doorbell's is never
connected to; a frame too long for the protocol is refused, not cut; a closed peer and a quiet one
are told apart.
"""

from __future__ import annotations

import socket
import threading

import pytest

from drafter.wire import doorbell

pytestmark = pytest.mark.skipif(not doorbell.available(), reason="abstract UNIX-domain sockets are Linux's")

TOKEN = "0123456789abcdef0123456789abcdef"


class Listening:
    """A doorbell listening, accept() on a thread; .conn once a hello passed (None if none did)."""

    def __init__(self, hello_s: float = 5.0):
        self.listener, self.address = doorbell.listen()
        self.stop = threading.Event()
        self.conn = None
        self.thread = threading.Thread(target=self._accept, args=(hello_s,), daemon=True)
        self.thread.start()

    def _accept(self, hello_s: float) -> None:
        self.conn = doorbell.accept(self.listener, TOKEN, lambda: not self.stop.is_set(), 0.05, hello_s)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.listener.close()
        if self.conn is not None:
            self.conn.close()


def _raw(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(doorbell.check_address(address))
    return s


def test_only_the_bindings_hello_gets_in_and_frames_go_both_ways():
    bell = Listening()
    try:
        stranger = _raw(bell.address)
        stranger.send(doorbell.HELLO + b"f" * 32)  # another binding's id
        assert doorbell.receive(stranger, 5) == b"", "a wrong hello is closed unanswered"
        stranger.close()
        target = doorbell.connect(bell.address, TOKEN, 5)
        bell.thread.join(10)
        assert bell.conn is not None
        target.send(b"header")
        assert doorbell.receive(bell.conn, 5) == b"header"
        bell.conn.send(b"done")
        assert doorbell.receive(target, 5) == b"done"
        assert doorbell.receive(target, 0.05) is None, "nothing more: a timeout, not a close"
        bell.conn.close()
        assert doorbell.receive(target, 5) == b"", "the drafter's end closed"
        target.close()
    finally:
        bell.close()


def test_a_silent_connection_is_dropped_and_the_target_still_gets_in():
    bell = Listening(hello_s=0.2)
    try:
        silent = _raw(bell.address)  # connects first and never says hello
        target = doorbell.connect(bell.address, TOKEN, 5)
        bell.thread.join(10)
        assert bell.conn is not None
        assert doorbell.receive(silent, 5) == b"", "the silent one was closed"
        silent.close()
        target.close()
    finally:
        bell.close()


def test_the_listener_accepts_one_hello_only_while_alive():
    bell = Listening()
    bell.stop.set()
    bell.thread.join(10)
    assert bell.conn is None, "a binding that ended accepts nothing"
    bell.close()


@pytest.mark.parametrize("address", ["@drafter-bell-xyz", "/tmp/drafter.sock", "@other-0123456789abcdef01234567",
                                     "@drafter-bell-0123456789abcdef01234567/../x"])
def test_an_address_that_is_not_a_doorbells_is_never_connected_to(address):
    with pytest.raises(ValueError):
        doorbell.connect(address, TOKEN, 1)


def test_an_address_nobody_listens_on_cannot_be_connected():
    listener, address = doorbell.listen()
    listener.close()  # the name is gone with the socket
    with pytest.raises(OSError):
        doorbell.connect(address, TOKEN, 1)


def test_a_frame_longer_than_the_protocol_is_refused_not_cut():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * doorbell.MAX_FRAME)
        a.send(b"x" * (doorbell.MAX_FRAME + 1))
        with pytest.raises(doorbell.FrameTooLong):
            doorbell.receive(b, 5)
        a.send(b"y" * doorbell.MAX_FRAME)
        assert doorbell.receive(b, 5) == b"y" * doorbell.MAX_FRAME
    finally:
        a.close()
        b.close()


def test_a_spin_catches_a_frame_that_comes_and_keeps_the_sockets_timeout():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    buf = bytearray(doorbell.MAX_FRAME)
    try:
        b.settimeout(0.1)
        assert doorbell.spin(b, 0.001, buf) is None, "nothing came"
        a.send(b"header")
        assert doorbell.spin(b, 5, buf) == b"header"
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * doorbell.MAX_FRAME)
        a.send(b"x" * (doorbell.MAX_FRAME + 1))
        with pytest.raises(doorbell.FrameTooLong):
            doorbell.spin(b, 5, buf)
        assert b.gettimeout() == 0.1
        a.close()
        assert doorbell.spin(b, 5, buf) == b"", "the peer closed"
    finally:
        a.close()
        b.close()

