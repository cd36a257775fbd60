"""With auth on, an unauthenticated peer gets nothing: mTLS on gRPC, CURVE on ZMQ."""

from __future__ import annotations

import shutil

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.transport import CurveConfig, GrpcDrafterClient, TlsConfig, ZmqDrafterClient
from drafter.wire.errors import Code, DrafterError
from tests.integration.conftest import SERVER_SETTINGS
from tests.support.certs import CA, curve_certificates
from tests.support.engines import tiny_dirs
from tests.support.servers import DrafterServer

NOTHING = 1.0  # seconds an unauthenticated client waits to get nothing


@pytest.fixture(scope="module")
def secured(tiny_root, tmp_path_factory, one_torch_thread):
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = CA(d, "drafter-ca"), CA(d, "rogue-ca")
    server_cert, server_key = ca.issue("drafter", server=True)
    keys = curve_certificates(d)
    clients = d / "curve-clients"
    clients.mkdir()
    shutil.copy(keys["client"][0], clients)  # only this client's public key is authorised
    _, model = tiny_dirs(tiny_root, "eagle3")
    server = DrafterServer(model, "eagle3", log_path=d / "server.log", kv_blocks=64, block_sizes=16,
                           tls_cert=server_cert, tls_key=server_key, tls_client_ca=ca.cert_path,
                           curve_server_cert=keys["server"][1], curve_clients_dir=clients, **SERVER_SETTINGS)
    with server:
        yield server, ca, rogue, keys


def test_grpc_with_a_client_certificate_works(secured):
    server, ca, _, _ = secured
    cert, key = ca.issue("target-worker", server=False)
    with GrpcDrafterClient(server.grpc_target, tls=TlsConfig(ca.cert_path, cert, key), timeout_s=10) as c:
        assert c.info().method == "eagle3"


@pytest.mark.parametrize("who", ["plaintext", "tls-without-certificate", "certificate-from-another-ca"])
def test_grpc_refuses_unauthenticated_peers(secured, who):
    server, ca, rogue, _ = secured
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
    server, _, _, keys = secured
    curve = CurveConfig(server_public=keys["server"][0], client_secret=keys["client"][1])
    with ZmqDrafterClient(server.zmq_endpoint, curve=curve, timeout_s=10) as c:
        assert c.info().method == "eagle3"


@pytest.mark.parametrize("who", ["no-curve", "wrong-server-key", "unlisted-client-key", "fresh-client-key"])
def test_zmq_refuses_clients_without_the_right_keys(secured, who):
    server, _, _, keys = secured
    import zmq
    curve = {"no-curve": None,
             "wrong-server-key": CurveConfig(server_public=zmq.curve_keypair()[0], client_secret=keys["client"][1]),
             "unlisted-client-key": CurveConfig(server_public=keys["server"][0], client_secret=keys["intruder"][1]),
             "fresh-client-key": CurveConfig(server_public=keys["server"][0])}[who]
    with ZmqDrafterClient(server.zmq_endpoint, curve=curve, timeout_s=NOTHING) as c:
        with pytest.raises(DrafterError) as e:
            c.info()
    assert e.value.code == Code.DEADLINE_EXCEEDED, "an unauthenticated ZMQ peer must get nothing at all"
