"""The host ring's stream: one plain stream connection per binding, the ring's prefix in chunks.

    drafter (Bind):         listener, address = listen(transport, host)  # -> BindResponse.stream
    drafter (its thread):   conns = accept(listener, bind_id, alive, poll_s, hello_s, lanes)
                            head_len, body_len, unit = read_prefix(conns[0])   # bounded before anything is read
                            head = read_exact(conns[0], head_len)        # a StepHeader
                            receive_striped(conns, ring, body_len, unit, landed, pool)  # into the pinned ring
                            send_message(conns[0], encoded StepDone, [drafts])
    target:                 conns = [connect(address, bind_id, timeout_s, lane) for lane in range(lanes)]
                            send_striped(conns, encoded StepHeader, nbytes, part, pool)

A message is PREFIX (three little-endian u32: the head's and the body's length, the body's stripe
unit), the head (a msgpack record), then the body, on the first connection (lane 0).  A binding
may stripe the body over several connections (lanes, at most MAX_LANES): each lane carries one
contiguous span of whole units (stripes(), which both ends compute from the body's length and
the unit), lane 0 the first, so the kernel's copies of a large body run on as many cores on each
side (one tcp stream is bound by the one core that copies it).  Within a stripe the sender writes
and the receiver reads up to a MiB per call (SEND_BYTES, RECV_BYTES), so a step costs each lane's
thread a few Python calls, not one per unit.  Replies come on lane 0 alone.  Why not a ZMQ frame: a ZMQ message of megabytes passes the sender's and
the receiver's libzmq I/O threads (three wake-ups a way), is delivered only once whole, and pyzmq's
recv_into copies it once more out of libzmq's message.  Here the target's thread writes the
kernel socket chunk by chunk as each chunk of its device-to-host copy lands, and the drafter's
thread reads each chunk straight from the kernel into its pinned ring and can queue that chunk's
host-to-device copy while the next one is still on the wire: the copies on both ends overlap the
transfer, and the GPU work starts on the last chunk.

Bounded: the head is at most MAX_HEAD bytes and the body at most the ring (the receiver checks
both lengths, and the body's against the header's nbytes, before it reads a byte of either:
FrameError names the field).  A connection first sends the binding's hello (HELLO + the bind id,
length-prefixed); any other connection is closed unanswered.

Addresses: "tcp://host:port" (the listener on the drafter's host, any port), or on one host
"@drafter-ring-<24 hex>", a Linux abstract UNIX-domain name (nothing on the file system).  Neither
is authenticated beyond the hello's 128-bit bind id, as the binding's ZMQ data socket is not:
the same trust domain.  Neutral: stdlib only.
"""

from __future__ import annotations

import hmac
import re
import secrets
import socket
import struct
import time
from typing import Callable, Iterable

PREFIX = struct.Struct("<III")  # head bytes, body bytes, the body's stripe unit (0: not striped)
MAX_HEAD = 1 << 16  # a StepHeader (sizes, a bind id, up to max_num_seqs accepted counts) or a StepDone
CHUNK = 1 << 18  # bytes: the stripe unit a sender uses (each lane carries whole units)
MIN_UNIT, MAX_UNIT = 1 << 10, 1 << 24  # the stripe units a receiver takes (powers of two)
SEND_BYTES = 1 << 20  # bytes per send call within a lane's stripe (each waits for its bytes to be on the host)
RECV_BYTES = 1 << 20  # bytes per receive call within a lane's stripe (each then landed: a host-to-device copy)
MAX_LANES = 8  # connections a binding's stream may stripe a body over
HELLO = b"drafter-ring hello "
OK = b"drafter-ring ok"
UNIX_PREFIX = "@drafter-ring-"
_UNIX = re.compile(r"@drafter-ring-[0-9a-f]{24}")


class FrameError(ValueError):
    """A message this stream cannot take: field names what was wrong ("header", "nbytes")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class Closed(ConnectionError):
    """The peer closed the connection (between or inside messages)."""


def _tune(sock: socket.socket) -> None:
    """No Nagle delay (a header must not wait for the next write).  The kernel buffers are left to
    tcp's autotuning (setting SO_RCVBUF turns it off and caps the buffer at net.core.rmem_max)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def listen(transport: str, host: str) -> tuple[socket.socket, str]:
    """A listener for one binding: tcp on host (any port) or ("ipc") a fresh abstract UNIX name;
    (socket, wire address).  OSError where it cannot be made."""
    if transport == "ipc":
        address = UNIX_PREFIX + secrets.token_hex(12)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        where = "\0" + address[1:]
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        where = (host, 0)
    try:
        sock.bind(where)
        sock.listen(4)
    except OSError:
        sock.close()
        raise
    if transport != "ipc":
        port = sock.getsockname()[1]
        address = f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
    return sock, address


def _target(address: str) -> tuple[int, object]:
    """(family, sockaddr) of a wire address; ValueError for anything else."""
    if _UNIX.fullmatch(address):
        return socket.AF_UNIX, "\0" + address[1:]
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        host = host.strip("[]")
        if host and port.isdigit():
            return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, int(port))
    raise ValueError(f"not a ring stream address: {address[:80]!r}")


def _hello(token: str, lane: int) -> bytes:
    return HELLO + token.encode() + (b"/%d" % lane if lane else b"")


def connect(address: str, token: str, timeout_s: float, lane: int = 0) -> socket.socket:
    """A connection to a binding's stream (lane `lane` of its lanes), its hello accepted within
    timeout_s.  OSError (or ValueError for an address that is not a stream's) where it cannot be made."""
    family, where = _target(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(timeout_s, 1e-3))
        sock.connect(where)
        _tune(sock)
        send_message(sock, _hello(token, lane), [])
        head, _ = read_message(sock, 0)
        if head != OK:
            raise ConnectionRefusedError("the drafter did not accept the ring stream's hello")
    except BaseException:
        sock.close()
        raise
    return sock


def accept(listener: socket.socket, token: str, alive: Callable[[], bool], poll_s: float,
           hello_s: float, lanes: int = 1) -> list[socket.socket] | None:
    """One connection per lane whose hello names `token` and that lane within hello_s (any other
    connection, or a lane's second, is closed unanswered), in lane order; None once alive() turns
    False or the listener fails.  Looks at alive() every poll_s."""
    listener.settimeout(poll_s)
    conns: dict[int, socket.socket] = {}
    while alive():
        if len(conns) == lanes:
            return [conns[i] for i in range(lanes)]
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            break
        lane = _greeted(conn, token, hello_s, lanes, conns)
        if lane is None:
            conn.close()
        else:
            conns[lane] = conn
    for conn in conns.values():
        conn.close()
    return None


def _greeted(conn: socket.socket, token: str, hello_s: float, lanes: int, taken) -> int | None:
    """The lane a connection's hello names (answered OK), or None (not answered)."""
    try:
        conn.settimeout(hello_s)
        longest = len(_hello(token, lanes))
        head_len, _, _ = read_prefix(conn, longest, 0)
        got = read_exact(conn, head_len)
        lane = next((i for i in range(lanes) if i not in taken and hmac.compare_digest(got, _hello(token, i))), None)
        if lane is None:
            return None
        _tune(conn)
        send_message(conn, OK, [])
        return lane
    except (OSError, ValueError):
        return None


def stripes(nbytes: int, lanes: int, unit: int) -> list[tuple[int, int]]:
    """Each lane's contiguous span [start, end) of a body of nbytes: whole units (the last one
    short), lane 0 first; the lanes past the last unit get an empty span.  Both ends compute it
    from the body's length and the unit the PREFIX carries."""
    units = -(-nbytes // unit)
    per = -(-units // lanes) * unit  # bytes per lane: whole units
    return [(min(nbytes, i * per), min(nbytes, (i + 1) * per)) for i in range(lanes)]


def send_striped(conns: list[socket.socket], head: bytes, nbytes: int, part: Callable[[int, int], object],
                 pool=None, unit: int | None = None, step: int | None = None) -> None:
    """PREFIX (with the stripe unit) and head on conns[0], then each lane's stripe (stripes) on its
    own connection, `step` bytes at a time: part(start, end) gives the bytes of [start, end) once
    they are ready (it may block until then).  pool: an executor with a worker per lane past the
    first (lanes > 1).  unit, step: CHUNK and SEND_BYTES unless given."""
    unit, step = unit or CHUNK, step or SEND_BYTES
    spans = stripes(nbytes, len(conns), unit)
    conns[0].sendall(PREFIX.pack(len(head), nbytes, unit) + head)

    def lane(i: int) -> None:
        start, end = spans[i]
        for a in range(start, end, step):
            conns[i].sendall(memoryview(part(a, min(end, a + step))).cast("B"))

    futures = [pool.submit(lane, i) for i in range(1, len(conns)) if spans[i][0] < spans[i][1]]
    try:
        lane(0)
    finally:
        errors = [f.exception() for f in futures]
    if any(errors):
        raise next(e for e in errors if e)


def receive_striped(conns: list[socket.socket], ring: memoryview, nbytes: int, unit: int,
                    landed: Callable[[int, int], None] | None = None, pool=None, step: int | None = None) -> None:
    """A body of nbytes striped by `unit` (its PREFIX and head read from conns[0]; 0: not
    striped, the whole body on conns[0]) straight into ring[:nbytes], each lane's stripe from its
    own connection, `step` bytes (RECV_BYTES unless given) per receive call, landed(start, end)
    called after each."""
    step = step or RECV_BYTES
    if not unit:
        conns, unit = conns[:1], max(nbytes, 1)
    spans = stripes(nbytes, len(conns), unit)
    futures = [pool.submit(receive_span, conns[i], ring, *spans[i], landed, step)
               for i in range(1, len(conns)) if spans[i][0] < spans[i][1]]
    try:
        receive_span(conns[0], ring, *spans[0], landed, step)
    finally:
        errors = [f.exception() for f in futures]
    if any(errors):
        raise next(e for e in errors if e)


def receive_span(sock: socket.socket, ring: memoryview, start: int, end: int,
                 landed: Callable[[int, int], None] | None = None, step: int = 1 << 20) -> None:
    """ring[start:end] from the stream, `step` bytes per receive call, landed(a, z) after each."""
    for a in range(start, end, step):
        z = min(end, a + step)
        receive_into(sock, ring[a:z])
        if landed is not None:
            landed(a, z)


def send_message(sock: socket.socket, head: bytes, body: Iterable, body_len: int | None = None) -> None:
    """PREFIX, head, then each body part (bytes-like) as it comes: body may be a generator that
    yields each chunk once it is ready (the sender's device-to-host copies).  body_len: the body's
    total bytes, needed up front where body is a generator."""
    parts = body if body_len is not None else list(body)
    total = body_len if body_len is not None else sum(memoryview(p).nbytes for p in parts)
    sock.sendall(PREFIX.pack(len(head), total, 0) + head)
    sent = 0
    for part in parts:
        view = memoryview(part).cast("B")
        sock.sendall(view)
        sent += view.nbytes
    if sent != total:
        raise ValueError(f"sent {sent} body bytes, announced {total}")


def read_prefix(sock: socket.socket, max_head: int = MAX_HEAD, max_body: int | None = None) -> tuple[int, int, int]:
    """The next message's (head bytes, body bytes, stripe unit), checked before anything else is
    read: FrameError "header" for a head over max_head (or empty), "nbytes" for a body over
    max_body, "unit" for a stripe unit that is not a power of two in [MIN_UNIT, MAX_UNIT] (0: a
    message that is not striped; a body then goes whole on this connection)."""
    head_len, body_len, unit = PREFIX.unpack(read_exact(sock, PREFIX.size))
    if not 0 < head_len <= max_head:
        raise FrameError("header", f"a head of {head_len} bytes (1 to {max_head})")
    if max_body is not None and body_len > max_body:
        raise FrameError("nbytes", f"a body of {body_len} bytes; at most {max_body} fit")
    if unit and (unit & (unit - 1) or not MIN_UNIT <= unit <= MAX_UNIT):
        raise FrameError("unit", f"a stripe unit of {unit} bytes: a power of two in [{MIN_UNIT}, {MAX_UNIT}]")
    return head_len, body_len, unit


def read_exact(sock: socket.socket, nbytes: int) -> bytes:
    """nbytes from the stream; Closed where the peer closed first."""
    buf = bytearray(nbytes)
    receive_into(sock, memoryview(buf))
    return bytes(buf)


def receive_into(sock: socket.socket, view: memoryview) -> None:
    """Fill view from the stream (the kernel copies straight into it); Closed where the peer closed first."""
    got, size = 0, view.nbytes
    while got < size:  # MSG_WAITALL: one call per view on a blocking socket (hold_timeout)
        n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if n == 0:
            raise Closed("the peer closed the ring stream")
        got += n


def read_message(sock: socket.socket, max_body: int) -> tuple[bytes, bytes]:
    """A small whole message (head, body) where the body is at most max_body bytes."""
    head_len, body_len, _ = read_prefix(sock, MAX_HEAD, max_body)
    return read_exact(sock, head_len), read_exact(sock, body_len)


def hold_timeout(sock: socket.socket, timeout_s: float) -> None:
    """The socket blocking, the kernel's receive timeout timeout_s (SO_RCVTIMEO): a whole chunk is
    one recv call (MSG_WAITALL, which a socket in Python's timeout mode cannot use), and a peer
    that stops inside a message for timeout_s makes it fail (BlockingIOError, an OSError)."""
    sock.settimeout(None)
    sec = int(timeout_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, int((timeout_s - sec) * 1e6)))


def wait_readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the socket has bytes (or the peer's close) to read within timeout_s."""
    import select

    return bool(select.select([sock], [], [], max(timeout_s, 0.0))[0])


def deadline_timeout(sock: socket.socket, deadline: float) -> None:
    """The socket's timeout set to what is left until deadline (time.monotonic()); TimeoutError
    where nothing is left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    sock.settimeout(left)
