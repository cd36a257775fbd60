"""`drafter serve --front-processes` (issue 19: the valid clients' p99 under attack): the public listeners in
child processes that decode and refuse; admitted calls reach the engine process over a private ipc socket.

Against one real server on loopback with mTLS and CURVE (the fronts authenticate; the engine process sees
the peer they forward), in this order (the last tests end it):
* Attach / Propose / Detach over gRPC and ZMQ (tcp and ipc) through the fronts draft what the solo engine
  drafts;
* malformed messages get the same code and field as from the plain-mode server, and are refused in the
  front: the engine process's /metrics never counts them;
* the authenticated peer reaches the engine process: another certificate or CURVE key cannot detach a
  session, and the per-client session cap counts one certificate's connections together;
* a front killed makes the server fail closed: a "front_failed" event, health and liveness NOT_SERVING,
  calls through the other front UNAVAILABLE; SIGTERM still stops it (code 0), the other front with it.
And one front process on its own: it exits when its stdin (the serving process's pipe) closes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

import grpc
import msgspec
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.transport import CurveConfig, GrpcDrafterClient, TlsConfig, ZmqDrafterClient
from drafter.service.config import ServerConfig
from drafter.wire import schema
from drafter.wire.errors import FIELD_METADATA_KEY, Code, DrafterError
from tests.integration.conftest import SERVER_SETTINGS, SESSION_BLOCKS, reference_engine
from tests.integration.test_service_ops import scrape, value
from tests.integration.test_service_parity import plans, scenario
from tests.support.auth_material import AuthMaterial, write_auth, zmq_exchange
from tests.support.engines import tiny_dirs
from tests.support.servers import REPO, DrafterServer, layout_for

_ENV = msgspec.msgpack.Decoder(schema.Envelope)
_ENC = msgspec.msgpack.Encoder()


@dataclasses.dataclass
class Fronted:
    server: DrafterServer
    auth: AuthMaterial

    def grpc_client(self, name: str) -> GrpcDrafterClient:
        return GrpcDrafterClient(self.server.grpc_target, timeout_s=60, tls=self.auth.mtls.client(name))

    def zmq_client(self, endpoint: str | None = None) -> ZmqDrafterClient:
        return ZmqDrafterClient(endpoint or self.server.zmq_endpoint, timeout_s=60, curve=self.auth.curve.config())


@pytest.fixture(scope="module")
def fronted(tiny_root, tmp_path_factory, one_torch_thread):
    """mTLS and CURVE, served through front processes; two sessions at most per authenticated client."""
    _, model = tiny_dirs(tiny_root, "eagle3")
    d = tmp_path_factory.mktemp("fronted")
    auth = write_auth(d)
    server = DrafterServer(model, "eagle3", log_path=d / "server.log", kv_blocks=4 * SESSION_BLOCKS, block_sizes=16,
                           batch_window_us=500, **auth.serve(), max_sessions_per_client=2,
                           zmq_ipc=str(d / "zmq.sock"), front_processes="true", **SERVER_SETTINGS).start()
    yield Fronted(server, auth)
    if server.proc.poll() is None:
        server.stop()


def _solo(tiny_root, seed: int) -> list:
    """The solo engine's drafts for one session of `seed` through every plan."""
    solo = reference_engine(tiny_root)
    s = scenario(solo, seed)
    return [solo.propose(**s.call(p).kwargs).draft_token_ids for p in plans()]


@pytest.mark.parametrize("transport", ["grpc", "zmq", "zmq-ipc"])
def test_drafts_through_the_fronts_equal_solo(fronted, tiny_root, transport):
    expected = _solo(tiny_root, 21)
    if transport == "grpc":
        c = fronted.grpc_client("drafts-grpc")
    else:  # the ZMQ front binds --zmq-ipc too, and "listening" reports it
        c = fronted.zmq_client(fronted.server.ready["zmq_ipc"] if transport == "zmq-ipc" else None)
    transport = transport.split("-")[0]
    try:
        info = c.info()
        assert info.state == "serving" and info.epoch == fronted.server.ready["epoch"]
        c.attach(layout_for(info, SESSION_BLOCKS, client_name=f"fronted-{transport}"))
        s = scenario(reference_engine(tiny_root), 21)
        for i, plan in enumerate(plans()):
            got = c.propose(**s.call(plan).kwargs).draft_token_ids
            assert torch.equal(got, expected[i]), f"{transport} step {i}"
        assert c.detach() == SESSION_BLOCKS
    finally:
        c.close()
    assert value(scrape(fronted.server), "drafter_requests_total", transport=transport, rpc="Propose",
                 code="OK") >= len(expected), "the engine process counts the forwarded calls under their transport"


# ---------------------------------------------------------------------- refusals: as plain mode, in the front
def _zmq_ask(endpoint: str, parts: list, curve: CurveConfig | None = None) -> tuple[str, str]:
    reply = zmq_exchange(endpoint, parts, curve, wait_s=30)
    assert reply is not None, "every message gets an answer"
    err = _ENV.decode(reply[0]).error
    return Code(err.code).name, err.field


def _grpc_ask(target: str, method: str, raw: bytes, tls: TlsConfig | None = None) -> tuple[str, str]:
    ch = grpc.insecure_channel(target) if tls is None else grpc.secure_channel(target, tls.credentials())
    with ch:
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


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_a_malformed_message_is_refused_by_the_front_as_in_plain_mode(fronted, eagle3_server, name):
    transport, what = REFUSALS[name]
    if transport == "zmq":
        plain = _zmq_ask(eagle3_server.zmq_endpoint, what)
        ask = lambda: _zmq_ask(fronted.server.zmq_endpoint, what, fronted.auth.curve.config())  # noqa: E731
    else:
        plain = _grpc_ask(eagle3_server.grpc_target, *what)
        tls = fronted.auth.mtls.client("refused")
        ask = lambda: _grpc_ask(fronted.server.grpc_target, *what, tls)  # noqa: E731
    assert plain[0] == "INVALID_ARGUMENT", plain
    before = value(scrape(fronted.server), "drafter_errors_total", code="INVALID_ARGUMENT")
    assert ask() == plain
    assert value(scrape(fronted.server), "drafter_errors_total", code="INVALID_ARGUMENT") == before, \
        "refused in the front: the engine process never saw it"


def test_the_grpc_fronts_health_service_follows_the_server(fronted):
    tls = fronted.auth.mtls.client("prober")
    with grpc.secure_channel(fronted.server.grpc_target, tls.credentials()) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_bind_is_refused_by_the_front(fronted):
    curve = fronted.auth.curve.config()
    assert _zmq_ask(fronted.server.zmq_endpoint, [_envelope("Bind"), b""], curve) == ("FAILED_PRECONDITION", "method")


# ---------------------------------------------------------------------- under auth: the peer reaches the engine
def test_a_session_is_detached_only_by_the_peer_that_attached_it(fronted):
    with fronted.grpc_client("owner") as owner, fronted.grpc_client("other") as other, \
            fronted.zmq_client() as zmq_peer:
        owner.attach(layout_for(owner.info(), 4))
        sid, epoch = owner.session.session_id, owner.session.epoch
        for thief in (other, zmq_peer):  # another certificate; an authorised CURVE key on the other transport
            thief.session.session_id, thief.session.epoch = sid, epoch
            with pytest.raises(DrafterError) as e:
                thief.detach()
            assert (e.value.code, e.value.field) == (Code.NOT_FOUND, "session_id")
        assert owner.detach() == 4


def test_sessions_per_authenticated_client_are_capped_across_connections(fronted):
    clients = [fronted.grpc_client("greedy") for _ in range(3)]
    try:
        layout = layout_for(clients[0].info(), 4)
        clients[0].attach(layout)
        clients[1].attach(layout)
        with pytest.raises(DrafterError) as e:
            clients[2].attach(layout)
        assert (e.value.code, e.value.field) == (Code.RESOURCE_EXHAUSTED, "session")
        for c in clients[:2]:
            c.detach()
    finally:
        for c in clients:
            c.close()


# ---------------------------------------------------------------------- a front lost (last: it ends the server)
def _health(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_a_killed_front_takes_the_server_out_of_service(fronted):
    server = fronted.server
    assert _health(server.health_target, "") == health_pb2.HealthCheckResponse.SERVING
    pids = server.ready["front_pids"]
    os.kill(pids["grpc"], signal.SIGKILL)
    ev = server.wait_for("front_failed", timeout=30)
    assert ev["transport"] == "grpc" and ev["returncode"] == -signal.SIGKILL
    for service in ("", "liveness"):
        assert _health(server.health_target, service) == health_pb2.HealthCheckResponse.NOT_SERVING, service
    with fronted.zmq_client() as c:  # the ZMQ front still answers; the engine refuses: fail closed
        with pytest.raises(DrafterError) as e:
            c.attach(layout_for(c.info(), 4))
        assert e.value.code == Code.UNAVAILABLE
    zmq_front = os.pidfd_open(pids["zmq"])
    try:
        assert server.stop(timeout=30) == 0
        assert select_readable(zmq_front, 30), "the ZMQ front ended with the server"
    finally:
        os.close(zmq_front)
    assert "the grpc front process exited" in server.log_tail(200_000)


def select_readable(fd: int, timeout: float) -> bool:
    """Whether `fd` turns readable within timeout (a pidfd does when its process exits)."""
    import select

    return bool(select.select([fd], [], [], timeout)[0])


def test_a_front_exits_when_the_serving_process_is_gone(tmp_path):
    """The front's stdin is a pipe from the serving process: when it closes (that process ended, however),
    the front exits at once, without a drain."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dataclasses.asdict(ServerConfig(method="eagle3", model="unused", zmq_port=0,
                                                                 log_format="json"))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "drafter.service.front", "--transport", "zmq", "--engine",
                             f"ipc://{tmp_path}/nobody.sock", "--config", str(config)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=env)
    try:
        ev = json.loads(proc.stdout.readline() or b"{}")
        assert ev.get("event") == "front_listening" and ev["zmq_port"] > 0, proc.stderr.read()[-2000:]
        proc.stdin.close()
        assert proc.wait(30) == 1
        assert b"front_orphaned" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
