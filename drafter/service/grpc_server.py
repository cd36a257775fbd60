"""The gRPC transport: grpc.aio, with the standard health service and reflection.

Requests arrive as raw bytes and are parsed here, so that even undecodable bytes get the
drafter's own answer (INVALID_ARGUMENT naming "request") rather than a generic INTERNAL.
A unary failure carries the status code and names the field in the trailing metadata
"drafter-field"; a stream answers each bad message with ProposeResponse.error and stays open.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
import traceback

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from drafter._proto.drafter.v1 import drafter_pb2 as pb
from drafter.wire import probes, schema
from drafter.service.core import ServiceCore
from drafter.wire.errors import FIELD_METADATA_KEY, Code, DrafterError
from drafter.wire.pbwire import request_from_raw
from drafter.wire.records import Caller
from drafter.wire.tensors import result_to_proto, struct_from_proto, struct_to_proto

log = logging.getLogger("drafter.service.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name  # drafter.v1.Drafter
LIVENESS = "liveness"  # SERVING as long as the engine makes progress (the kubelet's livenessProbe)
# A refused call's exception, its traceback and their frames form reference cycles, and the frames hold
# the request's bytes until the cyclic collector runs, which a few large requests do not trigger (it
# counts objects, not bytes): five refused 64 MiB requests held 1 GB.  So when a large request fails,
# the finished frames of its exception chain drop their locals at once (traceback.clear_frames).
LARGE_REQUEST_BYTES = 1024 * 1024


TRIM_INTERVAL_S = 1.0  # at most one heap trim a second, whatever the rate of large refusals


class HeapTrim:
    """Give the heap's free pages back to the OS after a large refused request, off the event loop.

    gRPC's core receives a request into slices allocated on whichever of its threads read it, so
    glibc spreads them over several malloc arenas, and each arena keeps its freed pages: RSS crept
    up ~40 MiB per 64 MiB refusal until every arena held one.  malloc_trim(0) returns the free
    pages of all arenas (madvise); it is glibc's, so elsewhere this does nothing.  Rate-limited, so a
    client cannot buy server CPU with it."""

    def __init__(self):
        self._last = -TRIM_INTERVAL_S
        self._pending = False
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            self._trim = None

    def soon(self) -> None:
        """A trim now, or one at the end of the current interval if one ran within it (requests
        in a burst share it, and the burst's last request's memory is trimmed too)."""
        if self._trim is None or self._pending:
            return
        loop = asyncio.get_running_loop()
        self._pending = True
        loop.call_later(max(0.0, self._last + TRIM_INTERVAL_S - time.monotonic()), self._run, loop)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        self._pending = False
        self._last = time.monotonic()
        loop.run_in_executor(None, self._trim, 0)


def release_frames(exc: BaseException | None) -> None:
    """Clear the locals of the finished frames in `exc`'s traceback and in those of its causes."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def peer_identity(context) -> str:
    """The authenticated client: its certificate's common name under mTLS, "" without client auth."""
    try:
        names = (context.auth_context() or {}).get("x509_common_name") or ()
    except Exception:  # noqa: BLE001 - no auth context on a plaintext port
        return ""
    return "x509:" + names[0].decode(errors="replace") if names else ""


def caller_of(context) -> Caller:
    """Who is calling: the authenticated peer (mTLS), and the connection (gRPC's peer address)."""
    try:
        connection = "grpc:" + context.peer()
    except Exception:  # noqa: BLE001 - a context without a peer (a test double)
        connection = ""
    return Caller(peer=peer_identity(context), connection=connection)


def _parse(cls, raw: bytes):
    try:
        return cls.FromString(raw)
    except (DecodeError, ValueError, TypeError) as exc:
        raise DrafterError(Code.INVALID_ARGUMENT, "request", f"not a drafter.v1.{cls.__name__}: {exc}") from None


def server_options(max_message_bytes: int, keepalive_time_s: float, keepalive_timeout_s: float) -> list:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Pings keep idle per-step streams alive through NATs and find dead targets.
        ("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Accept client pings as often as our own keepalive sends them, and no more often.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", int(keepalive_time_s * 1000) // 2),
        # Two servers silently sharing a port would split the sessions between them.
        ("grpc.so_reuseport", 0),
    ]


class DrafterGrpcService:
    def __init__(self, core: ServiceCore, drain_event: asyncio.Event):
        self.core = core
        self.drain_event = drain_event
        self._heap_trim = HeapTrim()

    def handler(self) -> grpc.GenericRpcHandler:
        ser = lambda m: m.SerializeToString()  # noqa: E731
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Attach": grpc.unary_unary_rpc_method_handler(self.attach, response_serializer=ser),
            "Propose": grpc.unary_unary_rpc_method_handler(self.propose, response_serializer=ser),
            "ProposeStream": grpc.stream_stream_rpc_method_handler(self.propose_stream, response_serializer=ser),
            "Detach": grpc.unary_unary_rpc_method_handler(self.detach, response_serializer=ser),
            "Info": grpc.unary_unary_rpc_method_handler(self.info, response_serializer=ser),
        })

    async def _unary(self, rpc: str, context, work, caller: Caller | None = None):
        try:
            async with self.core.serving("grpc", rpc, caller or caller_of(context)):
                return await work()
        except DrafterError as e:
            await context.abort(e.code.grpc, e.message, trailing_metadata=((FIELD_METADATA_KEY, e.field),))

    async def attach(self, raw: bytes, context):
        caller = caller_of(context)

        async def work():
            req = struct_from_proto(_parse(pb.AttachRequest, raw), schema.AttachRequest)
            return struct_to_proto(await self.core.attach(req, caller), pb.AttachResponse())
        return await self._unary("Attach", context, work, caller)

    async def detach(self, raw: bytes, context):
        caller = caller_of(context)

        async def work():
            req = struct_from_proto(_parse(pb.DetachRequest, raw), schema.DetachRequest)
            return struct_to_proto(await self.core.detach(req, caller=caller), pb.DetachResponse())
        return await self._unary("Detach", context, work, caller)

    async def info(self, raw: bytes, context):
        async def work():
            req = struct_from_proto(_parse(pb.InfoRequest, raw), schema.InfoRequest)
            return struct_to_proto(self.core.info(req), pb.InfoResponse())
        return await self._unary("Info", context, work)

    async def _propose_one(self, raw: bytes, context, caller: Caller, probe=None):
        call = request_from_raw(raw)  # tensors view `raw`: protobuf never copies the payloads
        call.caller = caller  # the session's owner check and the batcher's fair queueing read it
        call.probe = probes.labelled(probe, call)
        if probe is not None:
            probe.request_id = call.request_id
            probe.mark("tensor_decode")
        remaining = context.time_remaining()
        if remaining is not None:
            call.deadline = time.monotonic() + remaining
        result = await self.core.serve_propose(call)
        if probe is not None:
            probe.mark("handoff_out")
        resp = result_to_proto(result, pb.ProposeResponse)
        if probe is not None:
            probe.mark("reply_encode")
            probe.finish()
        return resp

    async def propose(self, raw: bytes, context):
        probe = probes.start("grpc-unary")
        big = len(raw) >= LARGE_REQUEST_BYTES
        caller = caller_of(context)
        try:
            return await self._unary("Propose", context, lambda: self._propose_one(raw, context, caller, probe),
                                     caller)
        except BaseException as exc:
            if big:
                del raw
                release_frames(exc)
                self._heap_trim.soon()
            raise

    async def propose_stream(self, request_iterator, context):
        drained = asyncio.ensure_future(self.drain_event.wait())
        caller = caller_of(context)  # one connection and peer for the whole stream
        try:
            while True:
                read = asyncio.ensure_future(context.read())
                await asyncio.wait({read, drained}, return_when=asyncio.FIRST_COMPLETED)
                if drained.done():  # between messages: the stream ends here, the client re-routes
                    read.cancel()
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter is draining",
                                        trailing_metadata=((FIELD_METADATA_KEY, ""),))
                raw = read.result()
                if raw is grpc.aio.EOF:
                    return
                probe = probes.start("grpc-stream")
                try:
                    async with self.core.serving("grpc", "ProposeStream", caller):
                        resp = await self._propose_one(raw, context, caller, probe)
                except DrafterError as e:
                    if e.code == Code.UNAVAILABLE:
                        await context.abort(e.code.grpc, e.message, trailing_metadata=((FIELD_METADATA_KEY, e.field),))
                    resp = pb.ProposeResponse(request_id=_request_id(raw),
                                              error=pb.Error(code=int(e.code), field=e.field, message=e.message))
                    if len(raw) >= LARGE_REQUEST_BYTES:
                        self._heap_trim.soon()
                await context.write(resp)
        finally:
            drained.cancel()


def _request_id(raw: bytes) -> int:
    try:
        return pb.ProposeRequest.FromString(raw).request_id
    except Exception:  # noqa: BLE001 - it was undecodable; the error says so
        return 0


class HealthState:
    """One grpc.health.v1 servicer shared by the main server and the plaintext health-only server."""

    def __init__(self):
        self.servicer = health.aio.HealthServicer()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.servicer.set("", status)
        await self.servicer.set(SERVICE_NAME, status)

    async def set_live(self, live: bool) -> None:
        await self.servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING if live
                                else health_pb2.HealthCheckResponse.NOT_SERVING)

    def add_to(self, server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def build_main_server(service: DrafterGrpcService, health_state: HealthState, *, host: str, port: int,
                      max_message_bytes: int, keepalive_time_s: float, keepalive_timeout_s: float,
                      tls_cert: str | None = None, tls_key: str | None = None,
                      tls_client_ca: str | None = None) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=server_options(max_message_bytes, keepalive_time_s, keepalive_timeout_s))
    server.add_generic_rpc_handlers((service.handler(),))
    health_state.add_to(server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = _address(host, port)
    if tls_cert or tls_key:
        if not (tls_cert and tls_key):
            raise ValueError("TLS needs both a certificate and its key")
        with open(tls_key, "rb") as f:
            key = f.read()
        with open(tls_cert, "rb") as f:
            cert = f.read()
        ca = None
        if tls_client_ca:
            with open(tls_client_ca, "rb") as f:
                ca = f.read()
        # With a client CA every peer must present a certificate it signed: no certificate, no call.
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {address}")
    return server, bound


def build_health_server(health_state: HealthState, *, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Plaintext, health only: kubelet probes cannot speak mTLS, and they need nothing else."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 4096)])
    health_state.add_to(server)
    address = _address(host, port)
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind the health server to {address}")
    return server, bound
