"""Bound sessions over the host ring: an attached session binds its buffers once, then steps.

    Bind (control socket, one dispatch branch of zmq_server):
        check the buffer layout once (names, dtypes, shapes, capacities, size)
        allocate the session's ring (pinned where CUDA is) and bind the engine ONCE to views into it
        open the session's data socket (its own ROUTER, tcp on the server's host or ipc)
    each step (the session's data thread):
        [identity, StepHeader, ring prefix]: the prefix is received straight into the ring (recv_into)
        the header's bind_id must be this binding's (else FAILED_PRECONDITION "bind_id")
        on the engine thread: the sizes on the host, the values by a few vectorised checks over the
        bound views (one flag word read back), the session's blocks moved into its pool range in
        place, bound.propose(num_tokens, batch)
        [identity, StepDone, drafts]

On the gloo_channel plane the data socket carries only [identity, StepHeader]; the prefix comes
by a point-to-point recv on the binding's two-rank gloo group (rank 1 here), straight into the
ring, from a TCPStore this drafter hosts for the binding.  Its bytes cannot be told apart from
the next step's, so a header that cannot be read ends the binding (FAILED_PRECONDITION: bind again).
The nccl_channel plane (drafter.service.bound_channel) is that channel with NCCL between two GPUs,
the step guard on the drafter's GPU and the output sent back down the channel.

No per-tensor Python work per step: no decode, no staging, no per-field range pass.  A step whose
flag word is set is refused with INVALID_ARGUMENT naming the first bad field and never reaches
the engine, so it writes no KV at all.  That is the CPU drafter's path; a drafter on a GPU serves
host-ring steps through drafter.service.bound_ipc.GuardedRingSession instead, whose step guard
(drafter.engine.step_guard) checks the same fields on the GPU, masks bad rows to the padding
slot and reports the first bad field in an error word.

A session's data thread ends when the session is gone (detach, expiry), the server closes, or the
session binds again.  The data sockets use a context of their own, so the server's context can
terminate while one is still closing.

Auth (docs/security.md): where the server's ZMQ has CURVE, every data socket is a CURVE server with
the same key pair under a ZAP domain of its own, and the plane's context runs its own ZAP handler
that completes a data socket's handshake only for the CURVE key that made its Bind (the binder;
the session's owner), so no other client, allowed on the control socket or not, can send it steps.  Where any auth is configured (CURVE
or mTLS), a Bind for a plane that cannot be authenticated is refused with FAILED_PRECONDITION
naming its field: the ring stream over tcp ("stream") and the channel planes, whose TCPStore and
gloo/NCCL connections are plain tcp ("plane"), unless the server runs with --insecure-bound-planes.
Same-host names (the ring stream and doorbell on abstract UNIX names, cuda_ipc) stay allowed.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
import secrets
import threading
import time

import torch
import torch.distributed as dist
import zmq

from drafter.service.batching.bound_steps import BoundSteps
from drafter.wire import bound as wb
from drafter.wire.bound_channel import DRAFTER_RANK, GLOO, close_group, open_group
from drafter.wire.errors import Code, DrafterError, InvalidInput, invalid
from drafter.wire.tensors import DTYPES

log = logging.getLogger("drafter.service.bound")

POLL_MS = 100  # how often an idle data thread looks whether its session or the server is gone
_CHANNEL_TIMEOUT = datetime.timedelta(seconds=30)  # the channel planes: joining, and each step's payload


def itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


def _kind(name: str) -> str:
    """The buffer family of a field name ("block_tables[1]" -> "block_tables")."""
    return name.split("[", 1)[0]


@dataclass(frozen=True)
class BoundAuth:
    """What the bound planes must authenticate (set by drafter.service.server on the ZmqServer as
    `bound_auth`).  required: some auth is configured (CURVE or mTLS); insecure_planes: serve the
    planes that cannot be authenticated anyway (--insecure-bound-planes)."""

    required: bool = False
    insecure_planes: bool = False


def auth_of(server) -> BoundAuth:
    """The server's BoundAuth; a ZmqServer built without one requires auth exactly when it has CURVE."""
    auth = getattr(server, "bound_auth", None)
    return auth if auth is not None else BoundAuth(required=bool(server.curve_server_cert))


class BoundPlane:
    """Every bound session of one ZmqServer (created at the first Bind)."""

    def __init__(self, server):
        self.server, self.core = server, server.core
        self.auth = auth_of(server)
        self.ctx = zmq.Context()
        self.curve: tuple[bytes, bytes] | None = None  # the server's CURVE (public, secret) key, when it has CURVE
        self._zap = None  # the ZAP handler of this plane's context: each data socket admits its binder only
        self._binders = _Binders()
        if server.curve_server_cert:
            self._start_curve(server.curve_server_cert)
        self.sessions: dict[str, "BoundSession"] = {}  # session id -> its binding
        self.steps = BoundSteps(self.core)  # steps pending for the engine, fused where several are (run_step)

    def _start_curve(self, cert: str) -> None:
        """The server's key pair for every data socket, and a ZAP handler on this plane's own context
        (ZAP is per context: without one CURVE would accept any client key) that asks _Binders."""
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = zmq.auth.load_certificate(cert)
        self.curve = (public, secret)
        self._zap = ThreadAuthenticator(self.ctx, log=logging.getLogger("drafter.service.bound.zap"))
        self._zap.start()

    def secure(self, sock: zmq.Socket, binder: str) -> str:
        """Make sock (before it binds) a CURVE server whose handshake completes only for binder
        ("curve:<z85 key>", the peer that made the Bind; "" admits nobody): a ZAP domain of its own,
        answered by _Binders.  The domain, for release() when the socket closes."""
        domain = self._binders.add(binder.removeprefix("curve:") if binder.startswith("curve:") else "")
        sock.curve_publickey, sock.curve_secretkey = self.curve
        sock.zap_domain = domain.encode()
        sock.curve_server = True
        self._zap.configure_curve_callback(domain=domain, credentials_provider=self._binders)
        return domain

    def release(self, domain: str) -> None:
        """Forget a closed data socket's domain (its binder no longer completes a handshake)."""
        self._binders.remove(domain)
        if self._zap is not None:
            self._zap.credentials_providers.pop(domain, None)

    @classmethod
    def of(cls, server) -> "BoundPlane":
        plane = getattr(server, "_bound_plane", None)
        if plane is None:
            plane = server._bound_plane = cls(server)
        return plane

    async def bind(self, rest: list, caller=None) -> wb.BindResponse:
        """Answer one Bind (frames after the envelope); raises DrafterError for the reply.  caller
        (drafter.wire.records.Caller): a session an authenticated peer attached binds for that peer
        only; for any other it does not exist (NOT_FOUND, as Propose and Detach answer)."""
        if len(rest) != 1:
            raise invalid("frames", "Bind takes one body frame")
        try:
            req = wb.BIND_DECODER.decode(rest[0].buffer)
        except Exception as exc:  # noqa: BLE001 - msgspec's errors name the path
            raise invalid("body", f"Bind: {exc}") from None
        core = self.core
        if req.epoch != core.epoch:
            raise DrafterError(Code.FAILED_PRECONDITION, "epoch", "the drafter restarted: attach (and bind) again")
        s = core.sessions.owned(req.session_id, caller.peer if caller is not None else "")
        if req.plane not in wb.PLANES:
            raise invalid("plane", f"{req.plane!r}; this drafter serves {list(wb.PLANES)}")
        if not 0 <= req.spin_us <= wb.MAX_SPIN_US:
            raise invalid("spin_us", f"{req.spin_us} must lie in [0, {wb.MAX_SPIN_US}]")
        if req.transport not in wb.TRANSPORTS or (req.transport == "ipc" and not self.server.ipc_endpoint):
            raise invalid("transport", f"{req.transport!r}: tcp, or ipc where the server listens on ipc")
        self.check_authenticated(req)
        slots, total = check_layout(req, s, core.desc)
        if total > core.max_message_bytes:
            raise invalid("buffers", f"the ring needs {total} bytes, more than max_message_bytes "
                                     f"{core.max_message_bytes}")
        old = self.sessions.pop(s.id, None)
        if old is not None:
            old.stop()
        loop = __import__("asyncio").get_running_loop()
        cls = BoundSession
        if req.plane == wb.CUDA_IPC:  # the slab shared once over CUDA IPC (drafter.service.bound_ipc)
            from drafter.service.bound_ipc import IpcBoundSession as cls
        elif req.plane == wb.NCCL_CHANNEL:  # GPU to GPU over NCCL (drafter.service.bound_channel)
            from drafter.service.bound_channel import ChannelSession as cls
        elif req.plane == wb.HOST_RING:  # the ring stream beside the data socket; on a GPU the checks there
            from drafter.service.ring_stream import ring_session_class

            cls = ring_session_class(core.engine)
        b = await loop.run_in_executor(core.executor, cls, self, s, req, slots, total)
        b.binder = caller.peer if caller is not None else ""
        b.open(self.ctx, self._endpoint(req.transport, b.bind_id))
        self.sessions[s.id] = b
        log.info("session bound", extra={"event": "bind", "session": s.id, "ring_bytes": total,
                                         "endpoint": b.endpoint})
        return wb.BindResponse(bind_id=b.bind_id, endpoint=b.endpoint, ring_bytes=total,
                               drafts_width=b.drafts.shape[1], store=b.store_endpoint, channel=b.bind_id,
                               output=getattr(b, "output_ref", None), drafts_event=getattr(b, "done_handle", b""),
                               doorbell=getattr(b, "doorbell_address", ""), stream=getattr(b, "stream_address", ""),
                               armed=getattr(b, "armed", False), drafts_event_odd=getattr(b, "odd_handle", b""))

    def check_authenticated(self, req: wb.BindRequest) -> None:
        """Where the server authenticates its clients, refuse a plane whose listeners could not
        (FAILED_PRECONDITION naming the field), unless --insecure-bound-planes says serve it anyway:
        the channel planes (a TCPStore and gloo/NCCL connections, plain tcp) and the ring stream
        over tcp.  The clients bind again without them (the host ring; the data socket's frames)."""
        if not self.auth.required or self.auth.insecure_planes:
            return
        if req.plane in wb.CHANNELS:
            raise DrafterError(Code.FAILED_PRECONDITION, "plane", (
                f"{req.plane} listens on plain tcp (a TCPStore, {req.plane.split('_')[0]}) and this server requires "
                "auth: bind host_ring or cuda_ipc, or start the drafter with --insecure-bound-planes"))
        if req.plane == wb.HOST_RING and req.stream and req.transport == "tcp":
            raise DrafterError(Code.FAILED_PRECONDITION, "stream", (
                "the ring stream over tcp is not authenticated and this server requires auth: bind without the "
                "stream (steps on the CURVE data socket), with transport ipc, or start the drafter with "
                "--insecure-bound-planes"))

    def close(self) -> None:
        """Stop every data thread and wait for it (its socket closes as it ends)."""
        for b in self.sessions.values():
            b.stop()
        for b in self.sessions.values():
            b.join()
        self.sessions.clear()
        if self._zap is not None:
            self._zap.stop()
        self.ctx.term()

    def _endpoint(self, transport: str, bind_id: str) -> str:
        if transport == "ipc":
            return f"{self.server.ipc_endpoint}.bound-{bind_id[:12]}"
        host = self.server.host
        return f"tcp://{'[' + host + ']' if ':' in host else host}:*"


class _Binders:
    """The ZAP answer of the bound data sockets (pyzmq's credentials provider, called on the ZAP
    thread): a handshake on a data socket's domain completes only for the key that bound it."""

    def __init__(self):
        self._keys: dict[str, str] = {}  # ZAP domain -> the binder's z85 public key ("" admits nobody)
        self._count = 0

    def add(self, key: str) -> str:
        self._count += 1
        domain = f"drafter-bound-{self._count}"
        self._keys[domain] = key
        return domain

    def remove(self, domain: str) -> None:
        self._keys.pop(domain, None)

    def callback(self, domain: str, key: bytes) -> bool:
        """key: the client's z85 public key, as pyzmq passes it."""
        want = self._keys.get(domain, "")
        return bool(want) and secrets.compare_digest(want.encode(), key)


def check_layout(req: wb.BindRequest, s, desc) -> tuple[list[wb.Slot], int]:
    """The buffers' structure, once: known names, one per field, wire dtypes the engine reads,
    shapes that fit the session; InvalidInput-style refusals naming the buffer."""
    if not req.buffers or len(req.buffers) > wb.MAX_BUFFERS:
        raise invalid("buffers", f"1 to {wb.MAX_BUFFERS} buffers")
    groups = len(s.num_blocks)
    allowed = set(wb.INT_BUFFERS) | {wb.HIDDEN} | {f"{k}[{g}]" for k in ("block_tables", "slot_mappings")
                                                  for g in range(groups)}
    names = [b.name for b in req.buffers]
    for b in req.buffers:
        if b.name not in allowed:
            raise invalid("buffers", f"unknown buffer {b.name!r}")
        if names.count(b.name) > 1:
            raise invalid(b.name, "registered twice")
        _check_buffer(b, s, desc)
    for name in (*wb.REQUIRED, *(f"{k}[{g}]" for k in ("block_tables", "slot_mappings") for g in range(groups))):
        if name not in names:
            raise invalid(name, "missing: a bound session registers every buffer a step reads")
    if not 0 < req.max_batch <= s.max_num_seqs:
        raise invalid("max_batch", f"{req.max_batch} must lie in [1, max_num_seqs {s.max_num_seqs}]")
    return wb.ring_layout(req.buffers, itemsize)


def _check_buffer(b: wb.BufferSpec, s, desc) -> None:
    if b.dtype not in DTYPES:
        raise invalid(b.name, f"dtype {b.dtype!r}; one of {sorted(DTYPES)}")
    if any(d <= 0 or d > 1 << 24 for d in b.shape):
        raise invalid(b.name, f"shape {b.shape}: every dimension in [1, 2**24]")
    kind = _kind(b.name)
    if kind == wb.HIDDEN:
        if DTYPES[b.dtype] != s.hidden_dtype or len(b.shape) != 2 or b.shape[1] != desc.hidden_width:
            raise invalid(b.name, f"expected [tokens, {desc.hidden_width}] {s.hidden_dtype}, got {b.shape} {b.dtype}")
        return
    if b.dtype not in ("int32", "int64"):
        raise invalid(b.name, f"dtype {b.dtype}: int32 or int64")
    if len(b.shape) != (2 if kind == "block_tables" else 1):
        raise invalid(b.name, f"shape {b.shape}: {'2-D' if kind == 'block_tables' else '1-D'}")


class BoundSession:
    """One session's ring, its engine binding and its data socket (built on the engine thread)."""

    binder = ""  # the authenticated peer that made the Bind (set before open); under CURVE the only key served
    zap_domain = ""  # under CURVE: the data socket's ZAP domain (BoundPlane.secure)

    def __init__(self, plane: BoundPlane, s, req: wb.BindRequest, slots: list[wb.Slot], total: int):
        self._own(plane, s, slots)
        engine = self.core.engine
        self.ring = torch.empty(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.ring.zero_()
        self.views = {sl.name: _view(self.ring, sl) for sl in slots}
        self.groups = len(s.num_blocks)
        self.drafts = torch.zeros(req.max_batch, _width(engine), dtype=torch.int64, device=engine.device)
        v = self.views
        try:
            self.bound = engine.bind(
                target_token_ids=v["target_token_ids"], target_positions=v["target_positions"],
                target_hidden_states=v[wb.HIDDEN], next_token_ids=v["next_token_ids"],
                query_start_loc=v["query_start_loc"], seq_lens=v["seq_lens"],
                block_tables=[v[f"block_tables[{g}]"] for g in range(self.groups)],
                slot_mappings=[v[f"slot_mappings[{g}]"] for g in range(self.groups)],
                token_indices_to_sample=v.get("token_indices_to_sample"),
                num_rejected_tokens=v.get("num_rejected_tokens"), drafts=self.drafts)
        except InvalidInput as exc:
            raise invalid(exc.field, str(exc)) from None
        self._link_state(req)

    def _own(self, plane: BoundPlane, s, slots: list[wb.Slot]) -> None:
        """Whose binding this is: the plane, the session, the ring's slots, a fresh bind id."""
        self.plane, self.session, self.slots = plane, s, slots
        self.core = plane.core
        self.bind_id = secrets.token_hex(16)

    def _link_state(self, req: wb.BindRequest) -> None:
        """The data link's state before open(): no socket, store, channel or thread yet."""
        self.plane_name = req.plane
        self.sock: zmq.Socket | None = None
        self.endpoint = ""
        self.store = None  # the channel planes: the TCPStore this drafter hosts for the binding
        self.store_endpoint = ""
        self.channel = None  # the channel planes: the two-rank process group, built by the data thread
        self._stop = threading.Event()
        self._steps_ready = threading.Event()  # set by the data thread once steps can run (its channel built)
        self._thread: threading.Thread | None = None
        self._accepted: list[int] = []  # the step's accepted counts (StepHeader), recorded after its reply

    # ------------------------------------------------------------------ data socket
    def open(self, ctx: zmq.Context, endpoint: str) -> None:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.ring.numel() + 4096)
        if self.plane.curve is not None:  # the server's key pair; the handshake completes for the binder only
            self.zap_domain = self.plane.secure(sock, self.binder)
        if endpoint.startswith("ipc://"):
            from drafter.wire.ipc import bind_ipc

            self.endpoint = bind_ipc(sock, endpoint)
        else:
            sock.bind(endpoint)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sock = sock
        if self.plane_name in wb.CHANNELS:
            host = self.plane.server.host
            self.store = dist.TCPStore(host, 0, 2, True, timeout=_CHANNEL_TIMEOUT, wait_for_workers=False)
            self.store_endpoint = f"{host}:{self.store.port}"
        self._thread = threading.Thread(target=self._serve, name=f"bound-{self.bind_id[:8]}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float = 10.0) -> None:
        """Wait for the data thread, at most timeout_s (a thread stuck in a transfer is a daemon: the
        server's close goes on without it)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _alive(self) -> bool:
        return not self._stop.is_set() and self.session.alive and not self.plane.server._closing

    def _serve(self) -> None:
        """The data thread: receive each step into the ring, run it on the engine thread, reply."""
        sock, ring = self.sock, memoryview(self.ring.numpy())
        try:
            if self.store is not None:  # waits for the target to join (rank 0), at most the timeout
                self.channel = self._open_channel()
            self._steps_ready.set()
            while self._alive():
                if not sock.poll(POLL_MS):
                    continue
                identity = sock.recv()
                self._accepted = []
                done, payload = self._receive_and_run(sock, ring)
                sock.send_multipart([identity, wb.encode(done), payload], copy=True)
                self._push(done, lambda frame: sock.send_multipart([identity, frame]))  # pre-drafts it asked for
                if self._accepted and not done.code:  # after the reply: off the step's path
                    self.core.metrics.record_acceptance(torch.tensor(self._accepted),
                                                        self.core.desc.num_speculative_tokens)
        except zmq.ZMQError as exc:
            log.debug("bound data socket ended: %s", exc)
        except (RuntimeError, TimeoutError, TypeError, ValueError) as exc:  # the channel failed (its peer went
            # away, a timeout, torch refusing an operation): the binding ends, the drafter serves on
            log.warning("bound channel ended: %s", exc, extra={"event": "bound_channel_failed"})
        finally:
            self._stop.set()
            close_group(self.channel)
            self.channel = self.store = None
            sock.close(linger=0)
            if self.zap_domain:
                self.plane.release(self.zap_domain)
            if self.endpoint.startswith("ipc://"):
                from drafter.wire.ipc import unlink_ipc

                unlink_ipc(self.endpoint)

    def _open_channel(self):
        """The gloo_channel's group (rank 1), joined here: blocks until the target joined, at most the timeout."""
        return open_group(GLOO, self.store, self.bind_id, DRAFTER_RANK, _CHANNEL_TIMEOUT)

    def _receive_and_run(self, sock: zmq.Socket, ring: memoryview) -> tuple[wb.StepDone, bytes]:
        header_frame = sock.recv() if sock.getsockopt(zmq.RCVMORE) else b""
        ring_frame = self.channel is None
        nbytes = sock.recv_into(ring) if ring_frame and sock.getsockopt(zmq.RCVMORE) else -1
        extra = 0
        while sock.getsockopt(zmq.RCVMORE):  # a malformed message: drain it, answer once
            sock.recv()
            extra += 1
        try:
            head = wb.STEP_DECODER.decode(header_frame)
        except Exception as exc:  # noqa: BLE001
            if not ring_frame:  # the channel's bytes cannot be told apart from the next step's: end it
                self._stop.set()
                return wb.StepDone(step=0, code=int(Code.FAILED_PRECONDITION), field="header",
                                   message=f"{exc}; the channel is closed, bind again"), b""
            return wb.StepDone(step=0, code=int(Code.INVALID_ARGUMENT), field="header", message=str(exc)), b""
        if not ring_frame and not extra:
            if not 0 <= head.nbytes <= len(ring):
                self._stop.set()
                return self._refused(head, DrafterError(Code.FAILED_PRECONDITION, "nbytes", (
                    f"{head.nbytes} bytes do not fit the ring of {len(ring)}; the channel is closed, bind again"))), b""
            self.channel.recv([self.ring[:head.nbytes]], 0, 0).wait()
            nbytes = head.nbytes
        if nbytes < 0 or extra:
            return self._refused(head, invalid("frames", "a step is [StepHeader, ring prefix] "
                                                         "([StepHeader] on a gloo channel)")), b""
        try:
            self.admit(head)
            drafts = self.run_step(head, nbytes)
        except DrafterError as exc:
            return self._refused(head, exc), b""
        except Exception as exc:  # noqa: BLE001 - a bug of ours: the step still gets its answer
            log.exception("bound step failed")
            return wb.StepDone(step=head.step, code=int(Code.INTERNAL), message=repr(exc)), b""
        return wb.StepDone(step=head.step), drafts

    def run_step(self, head: wb.StepHeader, nbytes: int) -> bytes:
        """self.step under the engine's lock, or, where other bindings' steps are pending when the
        lock is taken, this step inside their fused engine call (drafter.service.batching.bound_steps)."""
        return self.plane.steps.run(self, head, nbytes, self._on_engine)

    def _on_engine(self, fn, *args):
        """fn(*args) on the engine thread (drafter.service.bound_ipc's sessions run it on the data
        thread under the engine's lock)."""
        return self.core.executor.submit(fn, *args).result()

    def admit(self, head: wb.StepHeader) -> None:
        """The header's binding and report: a step for another binding is refused (it was meant for
        an earlier one: bind again); accepted counts, one per row, are kept for the metrics."""
        if head.bind_id != self.bind_id:
            raise DrafterError(Code.FAILED_PRECONDITION, "bind_id",
                               "the step is for another binding of this session: bind again")
        if head.accepted_counts:
            if len(head.accepted_counts) != head.batch:
                raise invalid("accepted_counts", f"{len(head.accepted_counts)} counts for a batch of {head.batch}")
            self._accepted = head.accepted_counts

    def _push(self, done: wb.StepDone, send, limit: int = 0, receive=None) -> bytes | None:
        """After a step's reply: push its pre-drafts where the plane makes them (cuda_ipc: bound_ipc);
        a frame read meanwhile from receive(seconds) that is the caller's next (none here)."""
        return None

    @staticmethod
    def _refused(head: wb.StepHeader, exc: DrafterError) -> wb.StepDone:
        return wb.StepDone(step=head.step, code=int(exc.code), field=exc.field, message=exc.message)

    # ------------------------------------------------------------------ one step (engine thread)
    def step(self, head: wb.StepHeader, nbytes: int) -> bytes:
        """Check, move into the session's pool range, replay; the drafts' bytes."""
        n, b = self._ready(head, nbytes)
        try:
            out = self.bound.propose(n, b, head.batch_padded or None, head.tokens_padded or None)
        except InvalidInput as exc:
            raise invalid(exc.field, str(exc)) from None
        return out[:b].cpu().numpy().tobytes()

    def _ready(self, head: wb.StepHeader, nbytes: int) -> tuple[int, int]:
        """The step's sizes and values checked (refusals naming the field), its blocks and slots
        moved into the session's pool range; (num_tokens, batch)."""
        n, b = head.num_tokens, head.batch
        s = self.session
        if not 0 < b <= min(self.drafts.shape[0], s.max_num_seqs):
            raise invalid("batch_size", f"{b} must lie in [1, {min(self.drafts.shape[0], s.max_num_seqs)}]")
        if not b <= n <= s.max_num_batched_tokens:
            raise invalid("num_tokens", f"{n} must lie in [batch={b}, {s.max_num_batched_tokens}]")
        want = wb.step_bytes(self.slots, n)
        if nbytes != want:
            raise invalid("ring", f"{nbytes} bytes for {n} tokens; the layout needs {want}")
        bad = first_bad_field(self.views, n, b, s, self.core.desc)
        if bad is not None:
            raise invalid(bad, "out of range for this session (or not finite); the step was not run")
        self._to_pool(n, b)
        s.calls += 1
        s.last_used = time.monotonic()
        return n, b

    # ------------------------------------------------------------------ a fused step (engine thread)
    # drafter.service.batching.bound_steps: fuse_part, then the engine's call over every part, then
    # fused_drafts, one host sync (where a step of the call has host_reply), fused_stamps and fused_reply.
    host_reply = True  # the answer carries the drafts: read on the host after the fused call

    def serve_alone(self, head: wb.StepHeader, nbytes: int):
        """The step's answer without fusion (the planes that stamp their steps time it here)."""
        return self.step(head, nbytes)

    def fuse_part(self, head: wb.StepHeader, nbytes: int):
        """The step made ready as step() makes it, its agreed sizes checked as its own call would
        check them; the rows of the binding's buffers the fused call reads (a ProposeInputs of views)."""
        n, b = self._ready(head, nbytes)
        self._check_plan(head)
        return self.bound.rows(n, b)

    def _check_plan(self, head: wb.StepHeader) -> None:
        try:
            self.bound.check(head.num_tokens, head.batch, head.batch_padded or None, head.tokens_padded or None)
        except InvalidInput as exc:
            raise invalid(exc.field, str(exc)) from None

    def fused_drafts(self, head: wb.StepHeader, rows: torch.Tensor) -> None:  # rows: [batch, width] int64
        """The step's drafts from the fused call into this binding's own output."""
        self.drafts[:rows.shape[0]].copy_(rows)

    def fused_reply(self, head: wb.StepHeader) -> bytes:
        """The answer of a fused step once its drafts are in the output (the host synced): their bytes."""
        return self.drafts[:head.batch].cpu().numpy().tobytes()

    def fused_stamps(self, started: int, queued: int) -> None:
        """A fused step's perf_counter_ns when the fused call began and when its GPU work was queued,
        where the session stamps its steps (the ring stream's, drafter.service.ring_stream)."""
        from drafter.service.ring_stream import _Stream

        if isinstance(self, _Stream):
            self._started, self._queued = started, queued

    def _to_pool(self, n: int, b: int) -> None:  # in place, in the ring: the next step overwrites it
        s = self.session
        for g, base in enumerate(s.bases):
            if base:
                self.views[f"block_tables[{g}]"][:b].add_(base)
                slots = self.views[f"slot_mappings[{g}]"][:n]
                slots.add_((slots >= 0).to(slots.dtype) * (base * s.block_sizes[g]))


def first_bad_field(v: dict, n: int, b: int, s, desc) -> str | None:
    """The first field of this step outside the session's limits, by vectorised checks over the
    bound views (one bool per field, one read back to the host); None when all are in range."""
    checks: list[tuple[str, torch.Tensor]] = []

    def outside(name: str, t: torch.Tensor, low: int, high: int) -> None:
        checks.append((name, ((t < low) | (t >= high)).any()))

    outside("target_token_ids", v["target_token_ids"][:n], 0, desc.vocab_size)
    outside("target_positions", v["target_positions"][:n], 0, s.max_model_len)
    checks.append((wb.HIDDEN, ~torch.isfinite(v[wb.HIDDEN][:n]).all()))
    outside("next_token_ids", v["next_token_ids"][:b], 0, desc.vocab_size)
    qsl = v["query_start_loc"][:b + 1]
    checks.append(("query_start_loc", (qsl[0] != 0) | (qsl[b] != n) | ((qsl[1:] - qsl[:-1]) < 1).any()))
    outside("seq_lens", v["seq_lens"][:b], 1, s.max_model_len + 1)
    for g, (blocks, size) in enumerate(zip(s.num_blocks, s.block_sizes)):
        outside(f"block_tables[{g}]", v[f"block_tables[{g}]"][:b], 0, blocks)
        outside(f"slot_mappings[{g}]", v[f"slot_mappings[{g}]"][:n], -1, blocks * size)
    if "token_indices_to_sample" in v:
        outside("token_indices_to_sample", v["token_indices_to_sample"][:b], 0, n)
    if "num_rejected_tokens" in v:
        outside("num_rejected_tokens", v["num_rejected_tokens"][:b], 0, desc.num_speculative_tokens + 1)
    flags = torch.stack([c for _, c in checks]).tolist()
    return next((name for (name, _), bad in zip(checks, flags) if bad), None)


def _view(ring: torch.Tensor, sl: wb.Slot) -> torch.Tensor:  # the slot's bytes as its dtype and shape
    return ring[sl.offset:sl.offset + sl.nbytes].view(DTYPES[sl.dtype]).view(sl.shape)


def _width(engine) -> int:
    return engine.graphs.width if engine.graphs is not None else engine.config.num_speculative_tokens
