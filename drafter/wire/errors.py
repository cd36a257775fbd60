"""Typed errors with the offending field named, the same on every transport.

Codes are the gRPC status codes (drafter.v1.ErrorCode uses the same numbers), so a gRPC
status, a stream's Error message and a ZMQ error header all say the same thing.
"""

from __future__ import annotations

import enum


class Code(enum.IntEnum):
    OK = 0
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5  # unknown session
    RESOURCE_EXHAUSTED = 8  # the pool cannot hold a session, too many sessions
    FAILED_PRECONDITION = 9  # stale epoch, layout mismatch
    INTERNAL = 13
    UNAVAILABLE = 14  # loading, draining

    @property
    def grpc(self):
        """The grpc.StatusCode of the same name (grpc imported here: the engine needs none of it)."""
        import grpc

        return getattr(grpc.StatusCode, self.name)

    @classmethod
    def from_grpc(cls, status) -> "Code":
        return cls.__members__.get(getattr(status, "name", ""), cls.INTERNAL)

# gRPC trailing-metadata key that names the offending field of a failed unary call.
FIELD_METADATA_KEY = "drafter-field"


class InvalidInput(ValueError):
    """A propose call's input is malformed; `field` names the culprit (raised by the engine's checks)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class DrafterError(Exception):
    """A refused call: `code` (Code), `field` (e.g. "block_tables[0]", "" when none applies), message."""

    def __init__(self, code: Code, field: str, message: str):
        super().__init__(f"{code.name} {field}: {message}" if field else f"{code.name}: {message}")
        self.code = Code(code)
        self.field = field
        self.message = message

    def __reduce__(self):  # keep it picklable for in-process use (never sent pickled)
        return (type(self), (self.code, self.field, self.message))


def invalid(field: str, message: str) -> DrafterError:
    return DrafterError(Code.INVALID_ARGUMENT, field, message)


def from_exception(exc: BaseException) -> DrafterError:
    """Map whatever a handler raised to a DrafterError; the engine's InvalidInput keeps its field."""
    if isinstance(exc, DrafterError):
        return exc
    if isinstance(exc, InvalidInput):
        return DrafterError(Code.INVALID_ARGUMENT, exc.field, str(exc).split(": ", 1)[-1])
    return DrafterError(Code.INTERNAL, "", f"{type(exc).__name__}: {exc}")
