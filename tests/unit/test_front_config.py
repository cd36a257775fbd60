"""--front-processes (drafter.service.front): off unless asked, a boolean flag or DRAFTER_FRONT_PROCESSES,
refused with the one flag it cannot serve; and the caller frame the engine side reads."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from drafter.service.config import add_arguments, from_args
from drafter.service.front import EngineSide
from drafter.wire.errors import DrafterError
from drafter.wire.records import Caller

BASE = ["--method", "eagle3", "--model", "/m"]


def _cfg(argv, environ=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = from_args(parser.parse_args(BASE + argv), environ or {})
    cfg.check()
    return cfg


def test_off_unless_asked_by_flag_or_environment():
    assert _cfg([]).front_processes is False
    assert _cfg(["--front-processes", "true"]).front_processes is True
    assert _cfg([], {"DRAFTER_FRONT_PROCESSES": "yes"}).front_processes is True
    assert _cfg(["--front-processes", "false"], {"DRAFTER_FRONT_PROCESSES": "1"}).front_processes is False


def test_a_value_that_is_not_a_boolean_is_refused():
    with pytest.raises(ValueError, match="DRAFTER_FRONT_PROCESSES"):
        _cfg([], {"DRAFTER_FRONT_PROCESSES": "sometimes"})


def test_bound_planes_cannot_be_asked_for_through_the_fronts():
    with pytest.raises(ValueError, match="--insecure-bound-planes.*--front-processes"):
        _cfg(["--front-processes", "true", "--insecure-bound-planes", "true"])


class _Frame:
    def __init__(self, data: bytes):
        self.buffer = memoryview(data)


def test_the_engine_side_reads_the_transport_and_caller_the_front_forwarded():
    side = EngineSide.__new__(EngineSide)  # _who reads only its arguments
    caller_frame = _Frame(msgspec.msgpack.encode(("grpc", "x509:owner", "grpc:ipv4:127.0.0.1:5")))
    rest = [caller_frame, _Frame(b"envelope"), _Frame(b"body")]
    transport, caller, after = side._who(None, b"front-id", rest)
    assert (transport, caller) == ("grpc", Caller(peer="x509:owner", connection="grpc:ipv4:127.0.0.1:5"))
    assert after == rest[1:]
    for bad in ([_Frame(b"\xc1"), _Frame(b"e")], [_Frame(msgspec.msgpack.encode(("zmq", "", "c")))]):
        with pytest.raises(DrafterError) as e:
            side._who(None, b"front-id", bad)
        assert e.value.field in ("caller", "envelope")
