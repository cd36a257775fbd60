"""Front processes (`drafter serve --front-processes`): the public listeners in processes of their own.

Without it one process receives, decodes and refuses on its event loop while its engine thread drafts,
and every refusal's Python holds the interpreter lock the engine thread takes back at each torch call.
With it the serving process (the engine's) starts one child per listening transport:

    gRPC front   the grpc.aio server (TLS/mTLS, size cap, health on its port), DrafterGrpcService
    ZMQ front    the ROUTER socket(s) (CURVE, frame and byte caps while receiving), ZmqServer

Each front decodes every message, refuses what the transport refuses (undecodable, oversized, unknown
method, a client past --max-inflight-per-client, draining) and logs those refusals (RefusalLog); what it
admits it forwards to the engine process over a private channel: a ZMQ DEALER connected to a ROUTER bound
on ipc:// in a directory of mode 0700 that the serving process made (EngineSide).  A forwarded message is
the ZMQ wire format (drafter.wire.schema) behind one more frame, the caller: msgpack [transport, peer,
connection] as the front authenticated it, so session ownership and quotas, checked in the engine
process with everything else that needs session state, see the same identities as without fronts.
Replies (and pushed pre-drafts) come back the same way, matched by the envelope's call id.

Control: the serving process writes one line per change on a front's stdin ("serving 0|1", "live 0|1",
"drain SECONDS"); the front reports on its stdout ("front_listening" with its ports, "front_failed",
"front_stopped").  A front exits when its stdin closes (the serving process is gone, however it ended);
the serving process takes itself out of service (health NOT_SERVING, calls UNAVAILABLE, "front_failed")
when a front exits while it was not draining.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

import msgspec
import zmq
import zmq.asyncio

from drafter.service.config import ServerConfig
from drafter.service.core import CallAccounting, CallRecord, InflightLimit
from drafter.service.grpc_server import DrafterGrpcService, HealthState, _parse, caller_of
from drafter.service.logs import RefusalLog
from drafter.service.metrics import Metrics
from drafter.service.zmq_server import ENVELOPE_SLACK, ZmqServer, _Endpoint
from drafter.wire import schema
from drafter.wire.errors import Code, DrafterError, from_exception, invalid
from drafter.wire.ipc import bind_ipc
from drafter.wire.predraft import push_from_frames
from drafter.wire.records import Caller, ProposeRequest, ProposeResult
from drafter.wire.tensors import request_to_frames, struct_from_proto, struct_to_proto, tensor_from_frames

log = logging.getLogger("drafter.service.front")

SOCKET_NAME = "engine.sock"
START_TIMEOUT_S = 120.0  # a front's imports and bind, on a slow host
PUSH_ROUTES = 4096  # calls whose pushed pre-drafts a front still relays (the latest ones)
_CALLER_TYPE = tuple[str, str, str]  # (transport, peer, connection)
_CALLER_DECODER = msgspec.msgpack.Decoder(_CALLER_TYPE)
_ENVELOPE = msgspec.msgpack.Decoder(schema.Envelope)
_RESPONSE = msgspec.msgpack.Decoder(schema.ProposeResponse)
_PUSH = msgspec.msgpack.Decoder(schema.PreDraftPush)
_DECODERS = {m: msgspec.msgpack.Decoder(resp) for m, (_, resp) in schema.METHODS.items()}
_ENCODER = msgspec.msgpack.Encoder()
SERVING, DRAINING = "serving", "draining"


# ====================================================================== the engine process's side
class EngineSide(ZmqServer):
    """The engine process's private ROUTER: messages from the fronts only, each [caller, envelope, body,
    tensors...]; the caller frame says which transport and whom (the front authenticated them)."""

    def __init__(self, core, directory: str, max_message_bytes: int):
        super().__init__(core, host="", port=0, max_message_bytes=max_message_bytes,
                         ipc_path=os.path.join(directory, SOCKET_NAME), ipc_mode=0o600, max_inflight=4096)

    def start(self) -> str:
        """Bind the ipc socket only (no tcp); returns its endpoint."""
        self._loop = asyncio.get_running_loop()
        sock = self._socket(tcp=False)
        try:
            self.ipc_endpoint = bind_ipc(sock, self.ipc_path, self.ipc_mode)
        except Exception:
            sock.close(linger=0)
            raise
        self.sock = sock
        self._eps.append(_Endpoint(sock, "front", self.ipc_endpoint))
        for ep in self._eps:
            self._watch(ep)
        return self.ipc_endpoint

    def _who(self, ep, identity: bytes, rest: list) -> tuple[str, Caller, list]:
        try:
            transport, peer, connection = _CALLER_DECODER.decode(rest[0].buffer)
        except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):
            raise invalid("caller", "a front's message without its caller frame") from None
        if len(rest) < 2:
            raise invalid("envelope", "missing envelope frame")
        return transport, Caller(peer=peer, connection=connection), rest[1:]


# ====================================================================== a front process's side
class EngineAnswer(DrafterError):
    """A refusal the engine process made (and logged): the front passes it on without logging it again."""


class EngineLink:
    """A front's DEALER to the engine process: a call goes out under a call id of the link's own, its reply
    (an envelope, then the reply's frames) comes back to the awaiting caller; pushes to a handler."""

    def __init__(self, endpoint: str, max_message_bytes: int):
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + ENVELOPE_SLACK)
        self.sock.connect(endpoint)
        self._next = 0
        self._waiting: dict[int, asyncio.Future] = {}
        self._pushes: collections.OrderedDict[int, object] = collections.OrderedDict()
        self._reader: asyncio.Task | None = None

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="engine-link")

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                env = _ENVELOPE.decode(frames[0].buffer)
            except (msgspec.ValidationError, msgspec.DecodeError, IndexError) as exc:
                log.error("undecodable reply from the engine process", exc_info=exc)
                continue
            if env.method == "PreDrafts":
                push = self._pushes.get(env.call_id)
                if push is not None:
                    push(frames[1:])
                continue
            fut = self._waiting.pop(env.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result((env, frames[1:]))

    async def call(self, transport: str, caller: Caller, method: str, body, tensors: list, timeout_ms: int = 0,
                   on_push=None) -> list:
        """Forward one admitted call; returns the reply's frames after its envelope (body, tensors...),
        or raises EngineAnswer with the engine's refusal."""
        self._next += 1
        call_id = self._next
        fut = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = fut
        if on_push is not None:
            self._pushes[call_id] = on_push
            while len(self._pushes) > PUSH_ROUTES:
                self._pushes.popitem(last=False)
        env = schema.Envelope(call_id=call_id, method=method, timeout_ms=timeout_ms)
        try:
            await self.sock.send_multipart([_ENCODER.encode((transport, caller.peer, caller.connection)),
                                            _ENCODER.encode(env), body, *tensors], copy=False)
            got, frames = await fut
        finally:
            self._waiting.pop(call_id, None)
        if got.error is not None:
            raise EngineAnswer(Code(got.error.code), got.error.field, got.error.message)
        return frames

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close(linger=0)
        self.ctx.term()


def _timeout_ms(call: ProposeRequest) -> int:
    if call.deadline is None:
        return 0
    return max(1, int((call.deadline - time.monotonic()) * 1000))


def _result(frames: list) -> ProposeResult:
    header = _RESPONSE.decode(frames[0].buffer)
    tensors = frames[1:]
    probs = None if header.draft_probs is None else tensor_from_frames("draft_probs", header.draft_probs, tensors)
    return ProposeResult(request_id=header.request_id,
                         draft_token_ids=tensor_from_frames("draft_token_ids", header.draft_token_ids, tensors),
                         draft_probs=probs, batch_padded=header.batch_padded, tokens_padded=header.tokens_padded)


class FrontCore(CallAccounting):
    """What the transports call on in a front process, in place of ServiceCore: the per-client in-flight
    cap, draining and the refusal log here; attach, detach, info and propose forwarded to the engine."""

    def __init__(self, link: EngineLink, transport: str, max_inflight_per_client: int):
        self.link, self.transport = link, transport
        self.state = SERVING  # while the engine loads, it answers UNAVAILABLE itself
        self.client_calls = InflightLimit(max_inflight_per_client)
        self.metrics = Metrics()  # the ZMQ transport's reply ledger; a front serves no /metrics
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._refusals = RefusalLog(logger=log)  # "drafter.service.front": refused here, not by the engine
        self._tasks: set[asyncio.Task] = set()

    # ---------------------------------------------------------------- accounting (as ServiceCore's)
    def begin(self, transport: str, rpc: str, caller: Caller | None = None) -> CallRecord:
        if self.state != SERVING:
            raise DrafterError(Code.UNAVAILABLE, "", f"the drafter is {self.state}")
        client = caller.client if caller is not None else ""
        try:
            self.client_calls.enter(client)
        except DrafterError as err:
            self._refusals.log(transport, rpc, err)
            raise
        self.inflight += 1
        self._idle.clear()
        return CallRecord(transport, rpc, time.perf_counter(), client)

    def finish(self, rec: CallRecord, exc: BaseException | None = None) -> DrafterError | None:
        err = None
        try:
            if exc is not None and not isinstance(exc, asyncio.CancelledError):
                err = from_exception(exc)
                if err.code == Code.INTERNAL and not isinstance(exc, EngineAnswer):
                    log.error("internal error", exc_info=exc, extra={"event": "internal_error",
                                                                      "transport": rec.transport, "rpc": rec.rpc})
                elif not isinstance(exc, EngineAnswer) and err.code != Code.UNAVAILABLE:
                    self._refusals.log(rec.transport, rec.rpc, err)
        finally:
            self.client_calls.leave(rec.client)
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()
        return err

    def start_draining(self) -> None:
        self.state = DRAINING

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # ---------------------------------------------------------------- forwarded calls
    async def _unary(self, method: str, req, caller: Caller | None):
        frames = await self.link.call(self.transport, caller or Caller(), method, _ENCODER.encode(req), [])
        return _DECODERS[method].decode(frames[0].buffer)

    async def attach(self, req: schema.AttachRequest, caller: Caller | None = None) -> schema.AttachResponse:
        return await self._unary("Attach", req, caller)

    async def detach(self, req: schema.DetachRequest, caller: Caller | None = None) -> schema.DetachResponse:
        return await self._unary("Detach", req, caller)

    async def info_of(self, req: schema.InfoRequest, caller: Caller | None = None) -> schema.InfoResponse:
        return await self._unary("Info", req, caller)

    async def serve_propose(self, call: ProposeRequest, push=None) -> ProposeResult:
        header, tensors = request_to_frames(call)
        relay = None
        if push is not None:
            def relay(frames):
                push(push_from_frames(_PUSH.decode(frames[0].buffer), frames[1:]))
        frames = await self.link.call(self.transport, call.caller or Caller(), "Propose", _ENCODER.encode(header),
                                      tensors, _timeout_ms(call), relay)
        return _result(frames)

    def serve_propose_nowait(self, call: ProposeRequest, on_done, reply=None, push=None) -> None:
        """As ServiceCore's: reply(result) then on_done(result), or on_done(error); here both in the loop."""
        task = asyncio.get_running_loop().create_task(self._propose_then(call, on_done, reply, push))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _propose_then(self, call: ProposeRequest, on_done, reply, push) -> None:
        try:
            result = await self.serve_propose(call, push)
        except BaseException as exc:  # noqa: BLE001 - on_done answers it
            on_done(exc)
            return
        if reply is not None:
            reply(result)
        on_done(result)

    def record_acceptance(self, call: ProposeRequest) -> None:
        """The engine process records acceptance of the calls it serves; nothing to do here."""


class FrontZmqServer(ZmqServer):
    """The public ZMQ listener of a ZMQ front: Info forwarded like any call; Bind refused."""

    LOCAL_INFO = False

    async def _dispatch(self, method: str, req, rest: list, caller: Caller):
        if method == "Bind":
            raise DrafterError(Code.FAILED_PRECONDITION, "method", "Bind (bound sessions) is not served with "
                                                                   "--front-processes; use Attach and Propose")
        return await super()._dispatch(method, req, rest, caller)


class FrontGrpcService(DrafterGrpcService):
    """The public gRPC service of a gRPC front: Info forwarded like any call."""

    async def info(self, raw: bytes, context):
        caller = caller_of(context)

        async def work():
            req = struct_from_proto(_parse(_pb().InfoRequest, raw), schema.InfoRequest)
            return struct_to_proto(await self.core.info_of(req, caller), _pb().InfoResponse())
        return await self._unary("Info", context, work, caller)


def _pb():
    from drafter._proto.drafter.v1 import drafter_pb2

    return drafter_pb2


async def _listen(cfg: ServerConfig, transport: str, core: FrontCore, health: HealthState,
                  drain_event: asyncio.Event):
    """Bind this front's public listener as the serving process would; returns (stop, ports)."""
    from drafter.service.grpc_server import build_main_server
    from drafter.service.server import _bind, _start_zmq
    from drafter.service.startup import check_port_free

    if transport == "grpc":
        check_port_free("grpc-port", cfg.host, cfg.grpc_port)
        server, port = _bind("grpc-port", cfg, cfg.grpc_port, lambda: build_main_server(
            FrontGrpcService(core, drain_event), health, host=cfg.host, port=cfg.grpc_port,
            max_message_bytes=cfg.max_message_bytes, keepalive_time_s=cfg.keepalive_time_s,
            keepalive_timeout_s=cfg.keepalive_timeout_s, tls_cert=cfg.tls_cert or None, tls_key=cfg.tls_key or None,
            tls_client_ca=cfg.tls_client_ca or None))
        await server.start()
        return server.stop, {"grpc_port": port}
    zs = FrontZmqServer(core, host=cfg.host, port=cfg.zmq_port, max_message_bytes=cfg.max_message_bytes,
                        heartbeat_s=cfg.keepalive_time_s, heartbeat_timeout_s=cfg.keepalive_timeout_s,
                        curve_server_cert=cfg.curve_server_cert or None,
                        curve_clients_dir=cfg.curve_clients_dir or None, ipc_path=cfg.zmq_ipc or None,
                        ipc_mode=cfg.ipc_mode, drop_burst=cfg.zmq_drop_burst,
                        drop_budget_s=cfg.zmq_drop_budget_us / 1e6)
    ports = {"zmq_port": _bind("zmq-port", cfg, cfg.zmq_port, lambda: _start_zmq(zs, cfg))}
    if zs.ipc_endpoint:
        ports["zmq_ipc"] = zs.ipc_endpoint
    return (lambda timeout: zs.close(timeout=max(0.1, timeout))), ports


def _say(name: str, **fields) -> None:
    print(json.dumps({"event": name, **fields}), flush=True)


async def _control(health: HealthState, core: FrontCore, drain_event: asyncio.Event) -> float | None:
    """Follow the serving process's lines until "drain" (returns its seconds) or stdin's end (None)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = (await reader.readline()).decode().split()
        if not line:
            return None
        word, value = line[0], line[1] if len(line) > 1 else ""
        if word == "serving":
            await health.set_serving(value == "1")
        elif word == "live":
            await health.set_live(value == "1")
        elif word == "drain":
            return float(value or 0)


async def run_front(cfg: ServerConfig, transport: str, endpoint: str) -> int:
    link = EngineLink(endpoint, cfg.max_message_bytes)
    link.start()
    core = FrontCore(link, transport, cfg.max_inflight_per_client)
    drain_event = asyncio.Event()
    health = HealthState()
    await health.set_serving(False)
    await health.set_live(True)
    try:
        stop, ports = await _listen(cfg, transport, core, health, drain_event)
    except Exception as exc:  # noqa: BLE001 - reported to the serving process, which says it once
        _say("front_failed", reason=str(exc), **{k: getattr(exc, k) for k in ("flag", "value", "problem", "fix")
                                                 if hasattr(exc, k)})
        return 1
    _say("front_listening", transport=transport, pid=os.getpid(), **ports)
    seconds = await _control(health, core, drain_event)
    if seconds is None:  # the serving process is gone: nothing to drain into
        log.error("the serving process is gone: this front exits", extra={"event": "front_orphaned"})
        os._exit(1)
    deadline = time.monotonic() + seconds
    core.start_draining()
    drain_event.set()
    await health.set_serving(False)
    clean = await core.wait_idle(max(0.0, deadline - time.monotonic()))
    done = stop(max(0.0, deadline - time.monotonic()))
    if asyncio.iscoroutine(done):
        await done
    link.close()
    _say("front_stopped", transport=transport, clean=clean)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m drafter.service.front")
    p.add_argument("--transport", choices=("grpc", "zmq"), required=True)
    p.add_argument("--engine", required=True, help="the engine process's private ipc:// endpoint")
    p.add_argument("--config", required=True, help="the serving process's settings (JSON, in its private dir)")
    args = p.parse_args(argv)
    # a terminal's ^C or a signal to the whole group reaches the serving process too: it drains the fronts
    # (a front that died of it would take the server out of service instead)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(args.config) as f:
        cfg = ServerConfig(**json.load(f))
    from drafter.service.logs import setup_logging

    setup_logging(cfg.log_format, cfg.log_level)
    code = asyncio.run(run_front(cfg, args.transport, args.engine))
    sys.stdout.flush()
    os._exit(code)


# ====================================================================== the serving process's handle
class Fronts:
    """The serving process's front processes: started (each bound) before "listening", told of health
    changes and of draining, watched: on_lost(transport, returncode) when one exits unasked."""

    def __init__(self, cfg: ServerConfig, core, on_lost):
        self.cfg, self.core, self.on_lost = cfg, core, on_lost
        self.dir = tempfile.mkdtemp(prefix="drafter-front-")  # mode 0700: this user only
        self.engine_side = EngineSide(core, self.dir, cfg.max_message_bytes)
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.stopping = False
        self._watchers: list[asyncio.Task] = []

    async def start(self) -> dict:
        """Bind the private socket, start a front per listening transport; returns their ports.  Raises
        the StartupError (or OSError) a front reported, after stopping every front started."""
        endpoint = self.engine_side.start()
        path = os.path.join(self.dir, "config.json")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            json.dump(dataclasses.asdict(self.cfg), f)
        for transport in (t for t in ("grpc", "zmq") if t in self.cfg.transport_set):
            self.procs[transport] = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "drafter.service.front", "--transport", transport, "--engine", endpoint,
                "--config", path, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        ports: dict = {}
        for transport, proc in self.procs.items():  # they start side by side; the first failure is raised
            ports.update(await self._listening(transport, proc))
        ports["front_pids"] = {t: p.pid for t, p in self.procs.items()}
        for transport, proc in self.procs.items():
            self._watchers.append(asyncio.get_running_loop().create_task(self._watch(transport, proc)))
        return ports

    async def _listening(self, transport: str, proc) -> dict:
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            line = b""
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            ev = {"event": "front_failed", "reason": f"the {transport} front process ended before it listened"}
        if ev.get("event") == "front_listening":
            return {k: v for k, v in ev.items() if k.endswith("_port") or k == "zmq_ipc"}
        if "flag" in ev:
            from drafter.service.startup import StartupError

            raise StartupError(ev["flag"], ev["value"], ev["problem"], ev["fix"])
        raise OSError(ev.get("reason") or f"the {transport} front process failed to start")

    async def _watch(self, transport: str, proc) -> None:
        code = await proc.wait()
        if not self.stopping:
            self.on_lost(transport, code)

    async def tell(self, line: str) -> None:
        for proc in self.procs.values():
            if proc.returncode is None and proc.stdin is not None and not proc.stdin.is_closing():
                try:
                    proc.stdin.write(line.encode() + b"\n")
                    await proc.stdin.drain()
                except (BrokenPipeError, ConnectionResetError):
                    pass

    async def drain(self, timeout: float) -> None:
        """Draining: the fronts refuse new calls, let open ones finish (within timeout) and exit."""
        self.stopping = True
        await self.tell(f"drain {timeout:.3f}")
        waits = [asyncio.ensure_future(p.wait()) for p in self.procs.values()]
        if waits:
            await asyncio.wait(waits, timeout=timeout + 1.0)

    async def close(self) -> None:
        """Stop every front (killed if still there) and the private socket; remove the private directory."""
        self.stopping = True
        for proc in self.procs.values():
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        for w in self._watchers:
            w.cancel()
        await self.engine_side.close(timeout=0.1)
        shutil.rmtree(self.dir, ignore_errors=True)


class FanoutHealth(HealthState):
    """The serving process's health, passed on to the fronts (the gRPC front serves health on its port)."""

    def __init__(self):
        super().__init__()
        self.fronts: Fronts | None = None
        self.serving, self.live = False, True

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        await super().set_serving(serving)
        if self.fronts is not None:
            await self.fronts.tell(f"serving {int(serving)}")

    async def set_live(self, live: bool) -> None:
        self.live = live
        await super().set_live(live)
        if self.fronts is not None:
            await self.fronts.tell(f"live {int(live)}")


if __name__ == "__main__":
    raise SystemExit(main())
