"""`drafter serve --front-processes` (issue 19: the valid clients' p99 under attack): the public listeners in
child processes that decode and refuse; admitted calls reach the engine process over a private ipc socket.

Against a real server on loopback (one for the file; the last test kills one of its fronts):
* Attach / Propose / Detach over gRPC and ZMQ through the fronts draft what the solo engine drafts (the
  plain mode's parity tests hold it to the same);
* malformed messages get the same code and field as from the plain-mode server, and are refused in the
  front: the engine process's /metrics never counts them;
* a front killed makes the server fail closed: a "front_failed" event, health and liveness NOT_SERVING,
  calls through the other front UNAVAILABLE, and SIGTERM still stops it cleanly.
"""

from __future__ import annotations

import os
import select
import signal

import grpc
import msgspec
import pytest
import torch
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.transport import GrpcDrafterClient, ZmqDrafterClient
from drafter.wire import schema
from drafter.wire.errors import FIELD_METADATA_KEY, Code
from tests.integration.conftest import SERVER_SETTINGS, SESSION_BLOCKS, reference_engine
from tests.integration.test_service_ops import scrape, value
from tests.integration.test_service_parity import plans, scenario
from tests.support.engines import tiny_dirs
from tests.support.servers import DrafterServer, layout_for

_ENV = msgspec.msgpack.Decoder(schema.Envelope)
_ENC = msgspec.msgpack.Encoder()


@pytest.fixture(scope="module")
def fronted(tiny_root, tmp_path_factory, one_torch_thread):
    _, model = tiny_dirs(tiny_root, "eagle3")
    log = tmp_path_factory.mktemp("logs") / "fronted-server.log"
    server = DrafterServer(model, "eagle3", log_path=log, kv_blocks=8 * SESSION_BLOCKS, block_sizes=16,
                           batch_window_us=500, front_processes="true", **SERVER_SETTINGS)
    server.start()
    yield server
    if server.proc.poll() is None:
        server.stop()


def _solo(tiny_root, seed: int) -> list:
    """The solo engine's drafts for one session of `seed` through every plan."""
    solo = reference_engine(tiny_root)
    s = scenario(solo, seed)
    return [solo.propose(**s.call(p).kwargs).draft_token_ids for p in plans()]


@pytest.mark.parametrize("transport", ["grpc", "zmq"])
def test_drafts_through_the_fronts_equal_solo(fronted, tiny_root, transport):
    expected = _solo(tiny_root, 21)
    c = GrpcDrafterClient(fronted.grpc_target, timeout_s=60) if transport == "grpc" \
        else ZmqDrafterClient(fronted.zmq_endpoint, timeout_s=60)
    try:
        info = c.info()
        assert info.state == "serving" and info.epoch == fronted.ready["epoch"]
        c.attach(layout_for(info, SESSION_BLOCKS, client_name=f"fronted-{transport}"))
        s = scenario(reference_engine(tiny_root), 21)
        for i, plan in enumerate(plans()):
            got = c.propose(**s.call(plan).kwargs).draft_token_ids
            assert torch.equal(got, expected[i]), f"{transport} step {i}"
        assert c.detach() == SESSION_BLOCKS
    finally:
        c.close()
    assert value(scrape(fronted), "drafter_requests_total", transport=transport, rpc="Propose", code="OK") >= \
        len(expected), "the engine process counts the forwarded calls under their transport"


# ---------------------------------------------------------------------- refusals: as plain mode, in the front
def _zmq_ask(endpoint: str, parts: list) -> tuple[str, str]:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send_multipart(parts)
        assert sock.poll(30_000), "every message gets an answer"
        err = _ENV.decode(sock.recv_multipart()[0]).error
        return Code(err.code).name, err.field
    finally:
        ctx.destroy(linger=0)


def _grpc_ask(target: str, method: str, raw: bytes) -> tuple[str, str]:
    with grpc.insecure_channel(target) as ch:
        call = ch.unary_unary(f"/drafter.v1.Drafter/{method}", lambda b: b, lambda b: b)
        with pytest.raises(grpc.RpcError) as got:
            call(raw, timeout=30)
    return got.value.code().name, dict(got.value.trailing_metadata() or ()).get(FIELD_METADATA_KEY, "")


def _envelope(method: str) -> bytes:
    return _ENC.encode(schema.Envelope(call_id=1, method=method))


def _bad_utf8_attach() -> bytes:
    body = _ENC.encode(schema.AttachRequest(client_name="QQQQ", protocol_version=1))
    return body.replace(b"QQQQ", b"\xff" * 4)


REFUSALS = {  # name -> (transport, what to send): three kinds of the abuse tests' malformed messages
    "zmq-too-many-frames": ("zmq", [_envelope("Propose"), b""] + [b"z"] * 5000),
    "zmq-attach-not-utf8": ("zmq", [_envelope("Attach"), _bad_utf8_attach()]),
    "grpc-propose-undecodable": ("grpc", ("Propose", b"\xff\xff\xff\xff")),
}


def _ask(server, transport: str, what) -> tuple[str, str]:
    if transport == "zmq":
        return _zmq_ask(server.zmq_endpoint, what)
    return _grpc_ask(server.grpc_target, *what)


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_a_malformed_message_is_refused_by_the_front_as_in_plain_mode(fronted, eagle3_server, name):
    transport, what = REFUSALS[name]
    plain = _ask(eagle3_server, transport, what)
    assert plain[0] == "INVALID_ARGUMENT", plain
    before = value(scrape(fronted), "drafter_errors_total", code="INVALID_ARGUMENT")
    assert _ask(fronted, transport, what) == plain
    assert value(scrape(fronted), "drafter_errors_total", code="INVALID_ARGUMENT") == before, \
        "refused in the front: the engine process never saw it"


def test_bind_is_refused_by_the_front(fronted):
    assert _zmq_ask(fronted.zmq_endpoint, [_envelope("Bind"), b""]) == ("FAILED_PRECONDITION", "method")


# ---------------------------------------------------------------------- a front lost (last: it ends the server)
def _health(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_a_killed_front_takes_the_server_out_of_service(fronted):
    assert _health(fronted.health_target, "") == health_pb2.HealthCheckResponse.SERVING
    os.kill(fronted.ready["front_pids"]["grpc"], signal.SIGKILL)
    ev = fronted.wait_for("front_failed", timeout=30)
    assert ev["transport"] == "grpc" and ev["returncode"] == -signal.SIGKILL
    for service in ("", "liveness"):
        assert _health(fronted.health_target, service) == health_pb2.HealthCheckResponse.NOT_SERVING, service
    c = ZmqDrafterClient(fronted.zmq_endpoint, timeout_s=30)
    try:
        with pytest.raises(Exception) as got:  # the ZMQ front still answers, the engine refuses: fail closed
            c.attach(layout_for(c.info(), SESSION_BLOCKS, client_name="after-front-lost"))
        assert "UNAVAILABLE" in str(got.value)
    finally:
        c.close()
    assert fronted.stop(timeout=30) == 0
    assert "the grpc front process exited" in fronted.log_tail(100_000)


def test_fronts_exit_with_the_serving_process(tiny_root, tmp_path, one_torch_thread):
    """However the serving process ends (here SIGKILL, no drain), its fronts do not outlive it."""
    _, model = tiny_dirs(tiny_root, "eagle3")
    server = DrafterServer(model, "eagle3", log_path=tmp_path / "server.log", kv_blocks=2 * SESSION_BLOCKS,
                           block_sizes=16, front_processes="true", **SERVER_SETTINGS).start()
    pids = server.ready["front_pids"]
    fds = {t: os.pidfd_open(pid) for t, pid in pids.items()}
    try:
        server.proc.kill()
        server.proc.wait(30)
        for transport, fd in fds.items():
            ready, _, _ = select.select([fd], [], [], 30)  # a pidfd turns readable when its process exits
            assert ready, f"the {transport} front outlived the serving process"
    finally:
        for fd in fds.values():
            os.close(fd)
