"""Structured logs on stderr: one JSON object per line (or plain text), fields from `extra=`.

stdout is reserved for the machine-readable lifecycle events of `drafter serve` (events()).
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_"))
        line = f"{self.formatTime(record)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        line = f"{line} {extra}" if extra else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(fmt: str = "json", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # grpc and asyncio debug chatter is not ours to spam with
    logging.getLogger("asyncio").setLevel(max(logging.WARNING, root.level))


def event(name: str, **fields) -> None:
    """One lifecycle event as a JSON line on stdout (the ready line tests and tooling wait for)."""
    sys.stdout.write(json.dumps({"event": name, **fields}) + "\n")
    sys.stdout.flush()


class RefusalLog:
    """One "call refused" warning per refused call, throttled on what the server decides, never on what
    the client writes: the key is (transport, rpc, code), where rpc is one of the server's own method names
    ("unknown" otherwise) and code one of a fixed enum, so at most len(transports x rpcs x codes) lines
    per `period` seconds, however many distinct field names or messages a client invents.  The first
    refusal of a key is logged with its field and reason; the next line of that key says how many were
    suppressed in between."""

    def __init__(self, period: float = 10.0, logger: logging.Logger | None = None):
        self.period = period
        self.logger = logger or logging.getLogger("drafter.service.core")
        self.last: dict[tuple, tuple[float, int]] = {}

    def log(self, transport: str, rpc: str, err) -> None:
        """err: a DrafterError (code, field, message)."""
        key = (transport, rpc, err.code)
        now = time.monotonic()
        since, suppressed = self.last.get(key, (-1e18, 0))
        if now - since < self.period:
            self.last[key] = (since, suppressed + 1)
            return
        self.last[key] = (now, 0)
        self.logger.warning("call refused", extra={"event": "refused", "transport": transport, "rpc": rpc,
                                                   "code": err.code.name, "field": err.field[:64],
                                                   "reason": err.message[:300], "suppressed_since_last": suppressed})


def session_tag(session_id: str) -> str:
    """What logs show of a session: a session id is a bearer token (whoever knows it may drive or
    detach the session), so log lines carry a short one-way tag that still ties them together."""
    import hashlib

    return hashlib.sha256(session_id.encode()).hexdigest()[:12]
