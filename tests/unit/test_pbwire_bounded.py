"""The Python work spent on one gRPC ProposeRequest is bounded before it is spent (issue 19, item 1):
a request of a million tiny unknown top-level fields is refused after at most MAX_TOP_FIELDS steps of
the Python walk (it used to walk every field on the event loop: ~1 us each, 10.8 s for 10 M)."""

from __future__ import annotations

import pytest

from drafter.wire import pbwire
from drafter.wire.errors import Code, DrafterError


def _unknown_varints(n: int, number: int = 100) -> bytes:
    key = pbwire._varint_bytes(number << 3 | 0)
    return (key + b"\x00") * n


class _Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a):
        self.calls += 1
        return self.fn(*a)


@pytest.fixture
def varint_calls(monkeypatch):
    counted = _Counted(pbwire._varint)
    monkeypatch.setattr(pbwire, "_varint", counted)
    return counted


def test_a_million_unknown_fields_are_refused_after_a_bounded_walk(varint_calls):
    raw = _unknown_varints(1_000_000)
    with pytest.raises(DrafterError) as e:
        pbwire.request_from_raw(raw)
    assert (e.value.code, e.value.field) == (Code.INVALID_ARGUMENT, "request")
    print(f"python varint reads for 1e6 fields: {varint_calls.calls}")
    assert varint_calls.calls <= 4 * pbwire.MAX_TOP_FIELDS


def test_a_tensor_with_a_million_shape_entries_leaves_the_python_walk_early(varint_calls):
    inner = b"".join([b"\x0a\x05int64"] + [b"\x10\x01"] * 1_000_000)  # dtype, then shape (unpacked) entries
    raw = pbwire._varint_bytes(4 << 3 | 2) + pbwire._varint_bytes(len(inner)) + inner
    with pytest.raises(DrafterError):
        pbwire.request_from_raw(raw)
    assert varint_calls.calls <= 4 * (pbwire.MAX_TOP_FIELDS + pbwire.MAX_TENSOR_FIELDS)


def test_a_few_unknown_fields_keep_protobufs_answer():
    from drafter.wire.tensors import request_from_proto
    raw = _unknown_varints(3)
    with pytest.raises(DrafterError) as fast:
        pbwire.request_from_raw(raw)
    with pytest.raises(DrafterError) as full:
        request_from_proto(pbwire.parse_request(raw))
    assert (fast.value.code, fast.value.field) == (full.value.code, full.value.field)
