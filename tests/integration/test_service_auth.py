"""With auth on, an unauthenticated peer gets nothing: mTLS on gRPC, CURVE on ZMQ."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.transport import CurveConfig, GrpcDrafterClient, TlsConfig, ZmqDrafterClient
from drafter.wire.errors import Code, DrafterError
from tests.integration.conftest import SERVER_SETTINGS
from tests.support.auth_material import CA, write_auth
from tests.support.engines import tiny_dirs
from tests.support.servers import DrafterServer

NOTHING = 1.0  # seconds an unauthenticated client waits to get nothing


@pytest.fixture(scope="module")
def secured(tiny_root, tmp_path_factory, one_torch_thread):
    """mTLS and CURVE (only "client"'s public key is on the allow list); a second CA the server does not trust."""
    d = tmp_path_factory.mktemp("pki")
    auth, rogue = write_auth(d), CA(d, "rogue-ca")
    _, model = tiny_dirs(tiny_root, "eagle3")
    server = DrafterServer(model, "eagle3", log_path=d / "server.log", kv_blocks=64, block_sizes=16, **auth.serve(),
                           **SERVER_SETTINGS)
    with server:
        yield server, auth, rogue


def test_grpc_with_a_client_certificate_works(secured):
    server, auth, _ = secured
    with GrpcDrafterClient(server.grpc_target, tls=auth.mtls.client("target-worker"), timeout_s=10) as c:
        assert c.info().method == "eagle3"


@pytest.mark.parametrize("who", ["plaintext", "tls-without-certificate", "certificate-from-another-ca"])
def test_grpc_refuses_unauthenticated_peers(secured, who):
    server, auth, rogue = secured
    ca = auth.mtls.ca
    tls = {"plaintext": None,
           "tls-without-certificate": TlsConfig(ca.cert_path),
           "certificate-from-another-ca": TlsConfig(ca.cert_path, *rogue.issue("intruder", server=False))}[who]
    with GrpcDrafterClient(server.grpc_target, tls=tls, timeout_s=NOTHING) as c:
        with pytest.raises(DrafterError) as e:
            c.info()
    assert e.value.code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED), e.value


def test_the_plaintext_health_port_serves_health_and_nothing_else(secured):
    server, *_ = secured
    with grpc.insecure_channel(server.health_target) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        info = ch.unary_unary("/drafter.v1.Drafter/Info", lambda b: b, lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            info(b"", timeout=10)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_zmq_with_the_authorised_key_works(secured):
    server, auth, _ = secured
    with ZmqDrafterClient(server.zmq_endpoint, curve=auth.curve.config(), timeout_s=10) as c:
        assert c.info().method == "eagle3"


@pytest.mark.parametrize("who", ["no-curve", "wrong-server-key", "unlisted-client-key", "fresh-client-key"])
def test_zmq_refuses_clients_without_the_right_keys(secured, who):
    server, auth, _ = secured
    import zmq
    keys = auth.curve.keys
    curve = {"no-curve": None,
             "wrong-server-key": CurveConfig(server_public=zmq.curve_keypair()[0], client_secret=keys["client"][1]),
             "unlisted-client-key": auth.curve.config("intruder"),
             "fresh-client-key": CurveConfig(server_public=keys["server"][0])}[who]
    with ZmqDrafterClient(server.zmq_endpoint, curve=curve, timeout_s=NOTHING) as c:
        with pytest.raises(DrafterError) as e:
            c.info()
    assert e.value.code == Code.DEADLINE_EXCEEDED, "an unauthenticated ZMQ peer must get nothing at all"
