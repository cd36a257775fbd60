"""A flooding ZMQ client in its own process (so its busy loop shares no interpreter lock with the
clients it is measured against): attaches a session, then sends one valid Propose on it over and over
without reading a reply, until `--most` are sent (or, with --stop-on-stdin, a line arrives on stdin).
Then (--then read) it reads the replies that reached it, or (--then detach) detaches its session from
another connection (its own is at its in-flight cap), and prints one JSON line: what it sent and the
replies read by status code.

    python -m tests.support.flood ENDPOINT TINY_ROOT [--most N] [--stop-on-stdin] [--then read|detach]

It prints {"event": "flooding"} once it has sent --ready-after messages (past any in-flight cap).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import msgspec
import zmq

from coordinator.transport import ZmqDrafterClient
from drafter.wire import schema
from drafter.wire.errors import Code

_ENC = msgspec.msgpack.Encoder()


def command(endpoint: str, tiny_root: Path, *options: str) -> tuple[list[str], dict]:
    """The argv and environment that run this flooder from a test (the repo on PYTHONPATH)."""
    import os

    from tests.support.servers import REPO

    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return ([sys.executable, "-m", "tests.support.flood", endpoint, str(tiny_root), *options],
            {**os.environ, "PYTHONPATH": path})


def _message(c: ZmqDrafterClient, tiny_root: Path) -> list:
    """One valid Propose on the client's session, as the frames a DEALER sends."""
    from tests.integration.conftest import reference_engine
    from tests.integration.test_service_parity import plans, scenario
    from tests.support.requests import to_frames

    kw = scenario(reference_engine(tiny_root), 99).call(next(plans())).kwargs
    header, frames = to_frames(c.session.session_id, c.session.epoch, 1, kw)
    return [b"", _ENC.encode(schema.Envelope(call_id=1, method="Propose")), _ENC.encode(header),
            *[bytes(f) for f in frames]]


def _flood(sock: zmq.Socket, msg: list, most: int, ready_after: int, stop: threading.Event) -> int:
    sent = 0
    while not stop.is_set() and sent < most:
        if not sock.poll(100, zmq.POLLOUT):  # its send queue is full: the server reads it no faster
            continue
        sock.send_multipart(msg, zmq.NOBLOCK)
        sent += 1
        if sent == ready_after:
            print(json.dumps({"event": "flooding"}), flush=True)
    return sent


def _replies(sock: zmq.Socket) -> tuple[dict, list]:
    """Replies by code name, and the distinct error messages (replies past its receive queue were dropped)."""
    codes: dict[str, int] = {}
    messages: set[str] = set()
    while sock.poll(3000, zmq.POLLIN):
        env = msgspec.msgpack.decode(sock.recv_multipart()[1], type=schema.Envelope)
        code = Code(env.error.code).name if env.error is not None else "OK"
        codes[code] = codes.get(code, 0) + 1
        if env.error is not None:
            messages.add(env.error.message)
    return codes, sorted(messages)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("endpoint")
    p.add_argument("tiny_root", type=Path)
    p.add_argument("--most", type=int, default=7000)
    p.add_argument("--ready-after", type=int, default=64)
    p.add_argument("--stop-on-stdin", action="store_true")
    p.add_argument("--then", choices=("read", "detach"), default="read")
    args = p.parse_args(argv)
    import torch

    from tests.integration.conftest import SESSION_BLOCKS
    from tests.support.servers import layout_for

    torch.set_num_threads(1)
    stop = threading.Event()
    if args.stop_on_stdin:
        threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    codes, messages = {}, []
    with ZmqDrafterClient(args.endpoint, timeout_s=60, context=zmq.Context()) as c:
        c.attach(layout_for(c.info(), SESSION_BLOCKS, client_name="flooder"))
        sent = _flood(c.sock, _message(c, args.tiny_root), args.most, args.ready_after, stop)
        if args.then == "read":
            codes, messages = _replies(c.sock)
        else:
            with ZmqDrafterClient(args.endpoint, timeout_s=60, context=c.ctx) as other:
                other.session.session_id, other.session.epoch = c.session.session_id, c.session.epoch
                other.detach()
    print(json.dumps({"event": "done", "sent": sent, "codes": codes, "messages": messages}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
