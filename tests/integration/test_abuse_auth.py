"""Auth on one transport must not leave the other open (issue 19, item 3).

mTLS alone used to leave plaintext ZMQ serving anyone; CURVE without an allow list accepted any key.
Now `drafter serve` refuses such a configuration in one line, serves it only under an explicit
--insecure-* flag (with a warning in the log), and can turn a transport off entirely.
"""

from __future__ import annotations

import json
import shutil

import pytest

from coordinator.transport import GrpcDrafterClient, TlsConfig, ZmqDrafterClient
from tests.integration.conftest import SERVER_SETTINGS
from tests.integration.test_startup_errors import _one_line, _serve
from tests.support.certs import CA, curve_certificates
from tests.support.engines import tiny_dirs
from tests.support.servers import DrafterServer


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = CA(d, "drafter-ca")
    cert, key = ca.issue("drafter", server=True)
    return d, ca, cert, key


@pytest.fixture(scope="module")
def eagle3(tiny_root):
    return tiny_dirs(tiny_root, "eagle3")[1]


def test_mtls_alone_refuses_to_start(eagle3, pki):
    _, ca, cert, key = pki
    run = _serve(eagle3, "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", ca.cert_path)
    _one_line(run, "--insecure-zmq", "--transports")


def test_curve_without_a_client_allow_list_refuses_to_start(eagle3, pki):
    d, ca, cert, key = pki
    keys = curve_certificates(d)
    run = _serve(eagle3, "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", ca.cert_path,
                 "--curve-server-cert", keys["server"][1])
    _one_line(run, "--curve-clients-dir")


def test_insecure_zmq_is_explicit_and_logged(eagle3, pki, tmp_path, one_torch_thread):
    _, ca, cert, key = pki
    log = tmp_path / "server.log"
    with DrafterServer(eagle3, "eagle3", log_path=log, kv_blocks=64, block_sizes=16, tls_cert=cert, tls_key=key,
                       tls_client_ca=ca.cert_path, insecure_zmq="true", **SERVER_SETTINGS) as server:
        with ZmqDrafterClient(server.zmq_endpoint, timeout_s=10) as c:
            assert c.info().method == "eagle3"
    warnings = [json.loads(ln) for ln in log.read_text().splitlines() if "insecure_transport" in ln]
    assert [w["transport"] for w in warnings] == ["zmq"] and warnings[0]["level"] == "warning"


def test_a_transport_can_be_turned_off(eagle3, pki, tmp_path, one_torch_thread):
    _, ca, cert, key = pki
    with DrafterServer(eagle3, "eagle3", log_path=tmp_path / "server.log", kv_blocks=64, block_sizes=16,
                       tls_cert=cert, tls_key=key, tls_client_ca=ca.cert_path, transports="grpc",
                       **SERVER_SETTINGS) as server:
        assert "zmq_port" not in server.ready
        worker = ca.issue("target-worker", server=False)
        with GrpcDrafterClient(server.grpc_target, tls=TlsConfig(ca.cert_path, *worker), timeout_s=10) as c:
            assert c.info().method == "eagle3"


def test_no_session_id_in_the_logs(eagle3, tmp_path, one_torch_thread):
    """A session id is a bearer token: INFO logs carry a one-way tag of it, never the id."""
    from drafter.service.logs import session_tag
    from tests.support.servers import layout_for

    log = tmp_path / "server.log"
    with DrafterServer(eagle3, "eagle3", log_path=log, kv_blocks=64, block_sizes=16, **SERVER_SETTINGS) as server:
        with ZmqDrafterClient(server.zmq_endpoint, timeout_s=10) as c:
            c.attach(layout_for(c.info(), 4))
            sid = c.session.session_id
            c.detach()
    text = log.read_text()
    assert sid not in text
    events = [json.loads(ln).get("event") for ln in text.splitlines() if session_tag(sid) in ln]
    assert events == ["attach", "detach"]


@pytest.fixture(scope="module")
def both_auth(eagle3, tmp_path_factory, one_torch_thread):
    """mTLS and CURVE, two sessions at most per authenticated client."""
    d = tmp_path_factory.mktemp("pki2")
    ca = CA(d, "drafter-ca")
    cert, key = ca.issue("drafter", server=True)
    keys = curve_certificates(d)
    clients = d / "curve-clients"
    clients.mkdir()
    shutil.copy(keys["client"][0], clients)
    with DrafterServer(eagle3, "eagle3", log_path=d / "server.log", kv_blocks=64, block_sizes=16, tls_cert=cert,
                       tls_key=key, tls_client_ca=ca.cert_path, curve_server_cert=keys["server"][1],
                       curve_clients_dir=clients, max_sessions_per_client=2, **SERVER_SETTINGS) as server:
        yield server, ca, keys


def _grpc_as(server, ca, name):
    return GrpcDrafterClient(server.grpc_target, tls=TlsConfig(ca.cert_path, *ca.issue(name, server=False)),
                             timeout_s=10)


def test_a_session_is_detached_only_by_the_peer_that_attached_it(both_auth):
    from coordinator.transport import CurveConfig
    from drafter.wire.errors import Code, DrafterError
    from tests.support.servers import layout_for

    server, ca, keys = both_auth
    with _grpc_as(server, ca, "owner") as owner, _grpc_as(server, ca, "other") as other, \
            ZmqDrafterClient(server.zmq_endpoint, timeout_s=10, curve=CurveConfig(
                server_public=keys["server"][0], client_secret=keys["client"][1])) as zmq_peer:
        owner.attach(layout_for(owner.info(), 4))
        sid, epoch = owner.session.session_id, owner.session.epoch
        for thief in (other, zmq_peer):  # another certificate; an authorised CURVE key on the other transport
            thief.session.session_id, thief.session.epoch = sid, epoch
            with pytest.raises(DrafterError) as e:
                thief.detach()
            assert (e.value.code, e.value.field) == (Code.NOT_FOUND, "session_id")
        owner.detach()


def test_sessions_per_authenticated_client_are_capped(both_auth):
    from drafter.wire.errors import Code, DrafterError
    from tests.support.servers import layout_for

    server, ca, _ = both_auth
    clients = [_grpc_as(server, ca, "greedy") for _ in range(3)]
    try:
        layout = layout_for(clients[0].info(), 4)
        clients[0].attach(layout)
        clients[1].attach(layout)
        with pytest.raises(DrafterError) as e:
            clients[2].attach(layout)
        assert (e.value.code, e.value.field) == (Code.RESOURCE_EXHAUSTED, "session")
        with _grpc_as(server, ca, "modest") as modest:  # another client still gets one
            modest.attach(layout)
            modest.detach()
        for c in clients[:2]:
            c.detach()
    finally:
        for c in clients:
            c.close()
