"""A flooding ZMQ client in its own process (so its busy loop shares no interpreter lock with the
client it is measured against): attaches a session, then sends one valid Propose on it over and over
without reading a reply, until a line arrives on stdin or `--most` are sent; then reads the replies
that reached it and prints one JSON line with what it sent and the replies by status code.

    python -m tests.support.flood ENDPOINT TINY_ROOT [--most N]

It prints {"event": "flooding"} once it has sent enough to be past any in-flight cap (--ready-after).
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
    args = p.parse_args(argv)
    import torch

    from tests.integration.conftest import SESSION_BLOCKS
    from tests.support.servers import layout_for

    torch.set_num_threads(1)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    with ZmqDrafterClient(args.endpoint, timeout_s=60, context=zmq.Context()) as c:
        c.attach(layout_for(c.info(), SESSION_BLOCKS, client_name="flooder"))
        sent = _flood(c.sock, _message(c, args.tiny_root), args.most, args.ready_after, stop)
        codes, messages = _replies(c.sock)
    print(json.dumps({"event": "done", "sent": sent, "codes": codes, "messages": messages}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
