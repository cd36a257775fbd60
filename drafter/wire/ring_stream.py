"""The host ring's stream: plain stream connections per binding (lanes), the ring's prefix striped over them.

    drafter (Bind):         listener, address = listen(transport, host)  # -> BindResponse.stream
    drafter (its thread):   conns = accept(listener, bind_id, alive, poll_s, hello_s, lanes)
                            lanes = Lanes(conns, ring, landed, alive, poll_s).start()  # a thread per lane past 0
                            head_len, body_len, used = read_prefix(conns[0], ..., max_lanes)  # bounded first
                            head = read_exact(conns[0], head_len)        # a StepHeader
                            seq = receive_body(conns[0], ring, body_len, used, lanes, landed, wait_s)
                            send_message(conns[0], encoded StepDone, [drafts])
    target:                 conns = [connect(address, bind_id, timeout_s, lane) for lane in range(lanes)]
                            spans = plan(nbytes, len(conns), lane_bytes)
                            send_head(conns[0], encoded StepHeader, nbytes, spans, seq)
                            send_stripes(conns, spans, seq, part, pool)   # or send_striped: both

A message is PREFIX (three little-endian u32: the head's and the body's length, the lanes the body
is striped over), the head (a msgpack record), then on each of the first `used` lanes (lane 0 right
after the head) a LANE record (the step, the stripe's first byte, its length) and that stripe.
used = 0 (replies, hellos): no LANE record, the body whole on this connection.  The sender picks
the stripes (plan(): contiguous, lane 0 first, at least lane_bytes each, so a small body wakes one
lane and a large one all of them); one tcp stream is bound by the one core that copies it, so the
kernel's copies of a large body run on as many cores as lanes on each side.  Each lane writes and
reads up to a MiB per call (SEND_BYTES, RECV_BYTES).  Replies come on lane 0 alone.

The receiver's lanes past the first each have a thread of their own blocked on their connection
(Lanes): a lane's bytes go into the ring as soon as they arrive, not after lane 0's head was read
and handed over.  Why not a ZMQ frame: a ZMQ message of megabytes passes the sender's and the
receiver's libzmq I/O threads, is delivered only once whole, and pyzmq's recv_into copies it once
more.  Here the target's thread writes the kernel socket piece by piece as its device-to-host copy
lands, and the drafter's thread reads each piece straight from the kernel into its pinned ring and
can queue that piece's host-to-device copy while the next one is still on the wire.

Bounded and validated per lane: the head is at most MAX_HEAD bytes, the body at most the ring, the
lanes used at most the binding's (read_prefix: FrameError names "header", "nbytes", "lanes" before
a byte of the head is read); a lane's stripe must lie inside the ring before a byte of it is read
(its own thread checks its LANE record: FrameError "lane"), and lane 0's inside the body; before the
step runs the stripes must tile the body exactly, lane by lane, all of one step (receive_body:
FrameError "lane" names a lane that sent more, less or another step's).  A lane whose connection
closes, fails or stays silent past wait_s fails the step (LaneLost), never hangs it.  A connection
first sends the binding's hello (HELLO + the bind id and lane); any other connection is closed
unanswered.

Addresses: "tcp://host:port" (the listener on the drafter's host, any port), or on one host
"@drafter-ring-<24 hex>", a Linux abstract UNIX-domain name (nothing on the file system).  Neither
is authenticated beyond the hello's 128-bit bind id, as the binding's ZMQ data socket is not:
the same trust domain.  Neutral: stdlib only.
"""

from __future__ import annotations

import hmac
import queue
import re
import secrets
import socket
import struct
import threading
import time
from typing import Callable, Iterable

PREFIX = struct.Struct("<III")  # head bytes, body bytes, lanes the body is striped over (0: whole, no LANE)
LANE = struct.Struct("<QQQ")  # ahead of each lane's stripe: the step, the stripe's first byte, its bytes
MAX_HEAD = 1 << 16  # a StepHeader (sizes, a bind id, up to max_num_seqs accepted counts) or a StepDone
CHUNK = 1 << 18  # bytes: the smallest stripe (a body under it goes on lane 0 alone); D2H pieces are whole chunks
LANE_BYTES = 1 << 20  # default: at least this many bytes per lane in use (plan(): fewer lanes for a smaller body)
ALIGN = 1 << 12  # stripes start on page boundaries
SEND_BYTES = 1 << 20  # bytes per send call within a lane's stripe (each waits for its bytes to be on the host)
RECV_BYTES = 1 << 20  # bytes per receive call within a lane's stripe (each then landed: a host-to-device copy)
MAX_LANES = 8  # connections a binding's stream may stripe a body over
MAX_REPLY = 1 << 20  # bytes of a reply's body read_reply takes whole
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


def plan(nbytes: int, lanes: int, lane_bytes: int = 0) -> list[tuple[int, int]]:
    """The stripes [start, end) of a body of nbytes over at most `lanes` lanes, lane 0 first,
    contiguous, page-aligned starts, none empty (one, maybe empty, for an empty body): as many lanes
    as give each at least max(lane_bytes, CHUNK) bytes (lane_bytes 0: CHUNK)."""
    floor = max(lane_bytes, CHUNK)
    used = max(1, min(lanes, nbytes // floor))
    per = -(-nbytes // used)
    if used > 1:
        per = -(-per // ALIGN) * ALIGN
    spans = [(min(nbytes, i * per), min(nbytes, (i + 1) * per)) for i in range(used)]
    return [s for s in spans if s[0] < s[1]] or [(0, 0)]


def send_head(conn: socket.socket, head: bytes, nbytes: int, spans: list[tuple[int, int]], seq: int) -> None:
    """PREFIX, the head and lane 0's LANE record on lane 0, in one write: the receiver can read and
    check them while the body is still being copied to the host."""
    start, end = spans[0]
    conn.sendall(PREFIX.pack(len(head), nbytes, len(spans)) + head + LANE.pack(seq, start, end - start))


def send_stripes(conns: list[socket.socket], spans: list[tuple[int, int]], seq: int,
                 part: Callable[[int, int], object], pool=None, step: int | None = None) -> None:
    """Each lane's stripe on its own connection (lanes past the first: their LANE record first, before
    their bytes are ready), `step` bytes (SEND_BYTES unless given) per send call: part(start, end)
    gives the bytes of [start, end) once they are ready (it may block until then).  pool: an
    executor with a worker per lane past the first in use."""
    step = step or SEND_BYTES

    def lane(i: int) -> None:
        start, end = spans[i]
        if i:
            conns[i].sendall(LANE.pack(seq, start, end - start))
        for a in range(start, end, step):
            conns[i].sendall(memoryview(part(a, min(end, a + step))).cast("B"))

    futures = [pool.submit(lane, i) for i in range(1, len(spans))]
    try:
        lane(0)
    finally:
        errors = [f.exception() for f in futures]
    if any(errors):
        raise next(e for e in errors if e)


def send_striped(conns: list[socket.socket], head: bytes, nbytes: int, part: Callable[[int, int], object],
                 pool=None, seq: int = 0, lane_bytes: int = 0, step: int | None = None) -> None:
    """A whole message: plan, send_head, send_stripes (lane_bytes: plan's)."""
    spans = plan(nbytes, len(conns), lane_bytes)
    send_head(conns[0], head, nbytes, spans, seq)
    send_stripes(conns, spans, seq, part, pool, step)


class LaneLost(ConnectionError):
    """A lane past the first closed, failed or stayed silent inside a message: the step fails."""

    def __init__(self, lane: int, message: str):
        super().__init__(message)
        self.lane = lane


class Lanes:
    """The receiving end of a binding's lanes past the first: a thread per lane blocked on its own
    connection, each stripe read into the ring as soon as its LANE record came (checked first: the
    stripe inside the ring), landed(start, end) after each receive call, then reported for
    receive_body to check against the message.  A lane whose record is out of bounds, whose peer
    closed or whose socket failed reports that and stops.  alive() False ends them (checked every
    poll_s while idle); on_thread runs first on each thread (its current device)."""

    def __init__(self, conns: list[socket.socket], ring: memoryview, landed: Callable[[int, int], None] | None,
                 alive: Callable[[], bool], poll_s: float, on_thread: Callable[[], None] | None = None):
        self.reports: queue.SimpleQueue = queue.SimpleQueue()  # (lane, seq, start, end, error or None)
        self._ring, self._landed, self._alive, self._poll_s, self._on_thread = ring, landed, alive, poll_s, on_thread
        self.threads = [threading.Thread(target=self._serve, args=(i, conns[i]), name=f"ring-lane-{i}", daemon=True)
                        for i in range(1, len(conns))]

    def start(self) -> "Lanes":
        for t in self.threads:
            t.start()
        return self

    def join(self, timeout_s: float) -> None:
        for t in self.threads:
            t.join(timeout_s)

    def _serve(self, lane: int, sock: socket.socket) -> None:
        try:
            if self._on_thread is not None:
                self._on_thread()
            while self._alive():
                if not wait_readable(sock, self._poll_s):
                    continue
                seq, start, size = LANE.unpack(read_exact(sock, LANE.size))
                if start + size > len(self._ring):
                    raise FrameError("lane", f"lane {lane}: a stripe of {size} bytes at {start}; the ring holds "
                                             f"{len(self._ring)}")
                receive_span(sock, self._ring, start, start + size, self._landed, RECV_BYTES)
                self.reports.put((lane, seq, start, start + size, None))
        except Exception as exc:  # noqa: BLE001 - reported to the step that waits for this lane
            if self._alive():
                self.reports.put((lane, 0, 0, 0, exc))


def receive_body(conn: socket.socket, ring: memoryview, nbytes: int, used: int, lanes: Lanes | None,
                 landed: Callable[[int, int], None] | None, wait_s: float, alive: Callable[[], bool] = lambda: True,
                 poll_s: float = 0.05) -> int | None:
    """A message's body of nbytes (its PREFIX and head read from conn, lane 0) into ring[:nbytes]:
    used 0, whole from conn (None); else lane 0's LANE record and stripe from conn (the stripe
    inside the body before a byte of it is read) and lanes 1..used-1's reports (all within wait_s
    of lane 0's stripe), then the step all stripes carry.  FrameError "lane" where the stripes do not tile [0, nbytes)
    lane by lane, a lane reports one this message does not have, or their steps differ; LaneLost
    where a lane failed or stayed silent (or alive() turned False)."""
    if not used:
        receive_span(conn, ring, 0, nbytes, landed, RECV_BYTES)
        return None
    seq, start, size = LANE.unpack(read_exact(conn, LANE.size))
    if start != 0 or size > nbytes:
        raise FrameError("lane", f"lane 0: a stripe of {size} bytes at {start} in a body of {nbytes}")
    receive_span(conn, ring, 0, size, landed, RECV_BYTES)
    spans = {0: (seq, 0, size)}
    deadline = time.monotonic() + wait_s
    while len(spans) < used:
        try:
            lane, got_seq, a, z, error = lanes.reports.get(timeout=poll_s)
        except queue.Empty:
            if time.monotonic() > deadline or not alive():
                missing = min(set(range(used)) - set(spans))
                raise LaneLost(missing, f"lane {missing}: no stripe within {wait_s:g} s") from None
            continue
        if error is not None:
            if isinstance(error, FrameError):
                raise error
            raise LaneLost(lane, f"lane {lane}: {error or type(error).__name__}") from error
        if lane >= used or lane in spans:
            raise FrameError("lane", f"lane {lane} sent a stripe this message does not have ({used} lanes)")
        spans[lane] = (got_seq, a, z)
    at = 0
    for lane in range(used):
        got_seq, a, z = spans[lane]
        if a != at or got_seq != seq:
            raise FrameError("lane", f"lane {lane}: step {got_seq} bytes [{a}, {z}); expected step {seq} from {at}")
        at = z
    if at != nbytes:
        raise FrameError("lane", f"the lanes carried {at} bytes of a body of {nbytes}")
    return seq


def receive_span(sock: socket.socket, ring: memoryview, start: int, end: int,
                 landed: Callable[[int, int], None] | None = None, step: int = 1 << 20) -> None:
    """ring[start:end] from the stream, `step` bytes per receive call, landed(a, z) after each."""
    for a in range(start, end, step):
        z = min(end, a + step)
        receive_into(sock, ring[a:z])
        if landed is not None:
            landed(a, z)


def send_message(sock: socket.socket, head: bytes, body: Iterable) -> None:
    """PREFIX, head and the body's parts (bytes-like), not striped, in one write."""
    parts = [memoryview(p).cast("B") for p in body]
    sock.sendall(b"".join([PREFIX.pack(len(head), sum(p.nbytes for p in parts), 0), head, *parts]))


def read_prefix(sock: socket.socket, max_head: int = MAX_HEAD, max_body: int | None = None,
                max_lanes: int = 0) -> tuple[int, int, int]:
    """The next message's (head bytes, body bytes, lanes used), checked before anything else is
    read: FrameError "header" for a head over max_head (or empty), "nbytes" for a body over
    max_body, "lanes" for more lanes than max_lanes (0: a message that is not striped, its body
    whole on this connection)."""
    return _checked(PREFIX.unpack(read_exact(sock, PREFIX.size)), max_head, max_body, max_lanes)


def _checked(prefix: tuple[int, int, int], max_head: int, max_body: int | None, max_lanes: int):
    head_len, body_len, used = prefix
    if not 0 < head_len <= max_head:
        raise FrameError("header", f"a head of {head_len} bytes (1 to {max_head})")
    if max_body is not None and body_len > max_body:
        raise FrameError("nbytes", f"a body of {body_len} bytes; at most {max_body} fit")
    if used > max_lanes:
        raise FrameError("lanes", f"a body striped over {used} lanes; this stream has {max_lanes}")
    return head_len, body_len, used


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
    """A small whole message (head, body), not striped, where the body is at most max_body bytes."""
    head_len, body_len, _ = read_prefix(sock, MAX_HEAD, max_body)
    return read_exact(sock, head_len), read_exact(sock, body_len)


def read_reply(sock: socket.socket, buf: bytearray, max_body: int) -> tuple[memoryview, memoryview]:
    """A reply (head, body; views into buf) where the peer sends nothing after it until asked: as
    many bytes as have come in one receive call (usually the whole reply), the rest exactly.  buf:
    at least PREFIX.size + MAX_HEAD + max_body bytes.  FrameError as read_prefix, or "reply" where
    more bytes came than the reply holds; Closed where the peer closed first."""
    view = memoryview(buf)
    got = 0
    while got < PREFIX.size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise Closed("the peer closed the ring stream")
        got += n
    head_len, body_len, _ = _checked(PREFIX.unpack_from(buf), MAX_HEAD, max_body, 0)
    total = PREFIX.size + head_len + body_len
    if got > total:
        raise FrameError("reply", f"{got - total} bytes past the reply")
    receive_into(sock, view[got:total])
    return view[PREFIX.size:PREFIX.size + head_len], view[PREFIX.size + head_len:total]


def hold_timeout(sock: socket.socket, timeout_s: float) -> None:
    """The socket blocking, the kernel's receive timeout timeout_s (SO_RCVTIMEO): a whole chunk is
    one recv call (MSG_WAITALL, which a socket in Python's timeout mode cannot use), and a peer
    that stops inside a message for timeout_s makes it fail (BlockingIOError, an OSError)."""
    sock.settimeout(None)
    sec = int(timeout_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, int((timeout_s - sec) * 1e6)))


def spin_readable(sock: socket.socket, spin_s: float) -> bool:
    """Whether the socket has bytes to read within spin_s, polled without sleeping (a reply that
    comes meanwhile is read without the thread's wake-up); False once spin_s passed."""
    import select

    end = time.perf_counter() + spin_s
    while time.perf_counter() < end:
        if select.select([sock], [], [], 0)[0]:
            return True
    return False


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
