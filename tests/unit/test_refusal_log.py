"""The refusal-log throttle is keyed on what the server decides, not on field names a client invents
(issue 19, item 6): a client sending a thousand refused messages, each naming a different unknown field,
writes one log line, not a thousand."""

from __future__ import annotations

import logging

from drafter.service.core import RefusalLog
from drafter.wire.errors import Code, DrafterError


def _refusals(caplog, errors, **where) -> list[logging.LogRecord]:
    throttle = RefusalLog(period=3600.0)
    with caplog.at_level(logging.WARNING):
        for err in errors:
            throttle.log(where.get("transport", "zmq"), where.get("rpc", "Propose"), err)
    return [r for r in caplog.records if getattr(r, "event", None) == "refused"]


def test_client_chosen_field_names_do_not_open_new_log_lines(caplog):
    errors = [DrafterError(Code.INVALID_ARGUMENT, f"made_up_{i}", f"unknown field `made_up_{i}`") for i in range(1000)]
    lines = _refusals(caplog, errors)
    assert len(lines) == 1
    assert lines[0].field == "made_up_0"


def test_each_code_still_gets_its_own_line(caplog):
    errors = [DrafterError(Code.INVALID_ARGUMENT, "a", "x"), DrafterError(Code.NOT_FOUND, "session", "y"),
              DrafterError(Code.INVALID_ARGUMENT, "b", "z")]
    assert [r.code for r in _refusals(caplog, errors)] == ["INVALID_ARGUMENT", "NOT_FOUND"]


def test_a_long_client_field_is_cut_in_the_line(caplog):
    lines = _refusals(caplog, [DrafterError(Code.INVALID_ARGUMENT, "f" * 10_000, "m" * 10_000)])
    assert len(lines[0].field) <= 64 and len(lines[0].reason) <= 300
