"""The ZMQ transport under abuse (issue 19, items 2 and 5), against a real `drafter serve` on loopback.

* An oversized message (too many frames, or more bytes than max_message_bytes) is refused with
  INVALID_ARGUMENT naming "frames", and the same peer is served normally right after.
* A string field holding bytes that are not UTF-8 is INVALID_ARGUMENT naming that field (it used to be
  INTERNAL with a traceback in the log per message).
"""

from __future__ import annotations

import msgspec
import pytest
import zmq

from drafter.wire import schema
from drafter.wire.errors import Code

_ENV = msgspec.msgpack.Decoder(schema.Envelope)
_ENC = msgspec.msgpack.Encoder()


@pytest.fixture
def dealer(eagle3_server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(eagle3_server.zmq_endpoint)
    yield sock
    ctx.destroy(linger=0)


def _ask(sock, parts: list) -> schema.Envelope:
    sock.send_multipart(parts)
    assert sock.poll(30_000), "the server must answer every message"
    reply = sock.recv_multipart()
    return _ENV.decode(reply[0])


def _envelope(method: str, call_id: int = 1) -> bytes:
    return _ENC.encode(schema.Envelope(call_id=call_id, method=method))


def _info_works(sock) -> None:
    env = _ask(sock, [_envelope("Info", 99), b""])
    assert env.error is None and env.call_id == 99


def test_too_many_frames_is_refused_and_the_peer_is_served_after(dealer):
    env = _ask(dealer, [_envelope("Propose"), b""] + [b"z"] * 5000)
    assert (Code(env.error.code), env.error.field) == (Code.INVALID_ARGUMENT, "frames")
    _info_works(dealer)


def test_too_many_bytes_is_refused_and_the_peer_is_served_after(dealer, eagle3_server):
    limit = 256 * 1024 * 1024  # the server's default max_message_bytes
    chunk = b"\0" * (16 * 1024 * 1024)
    env = _ask(dealer, [_envelope("Propose"), b""] + [chunk] * (limit // len(chunk) + 1))
    assert (Code(env.error.code), env.error.field) == (Code.INVALID_ARGUMENT, "frames")
    _info_works(dealer)


def _with_bad_utf8(encoded: bytes, marker: bytes) -> bytes:
    assert encoded.count(marker) == 1
    return encoded.replace(marker, b"\xff" * len(marker))


def test_invalid_utf8_in_a_body_string_names_the_field(dealer):
    body = _with_bad_utf8(_ENC.encode(schema.AttachRequest(client_name="QQQQ", protocol_version=1)), b"QQQQ")
    env = _ask(dealer, [_envelope("Attach"), body])
    assert (Code(env.error.code), env.error.field) == (Code.INVALID_ARGUMENT, "client_name"), env.error
    _info_works(dealer)


def test_invalid_utf8_in_the_envelope_names_the_field(dealer):
    raw = _with_bad_utf8(_envelope("QQQQ"), b"QQQQ")
    env = _ask(dealer, [raw, b""])
    assert (Code(env.error.code), env.error.field) == (Code.INVALID_ARGUMENT, "method"), env.error
