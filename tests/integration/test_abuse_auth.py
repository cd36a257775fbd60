"""Auth on one transport must not leave the other open (issue 19, item 3).

mTLS alone used to leave plaintext ZMQ serving anyone; CURVE without an allow list accepted any key.
Now `drafter serve` refuses such a configuration in one line, serves it only under an explicit
--insecure-* flag (with a warning in the log), and can turn a transport off entirely.
"""

from __future__ import annotations

import json

import pytest

from coordinator.transport import GrpcDrafterClient, ZmqDrafterClient
from tests.integration.conftest import SERVER_SETTINGS
from tests.integration.test_startup_errors import _one_line, _serve
from tests.support.auth_material import as_flags, write_auth, write_curve, write_mtls
from tests.support.engines import tiny_dirs
from tests.support.servers import DrafterServer


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The server's mTLS material (a CA and its certificate), and the directory it lies in."""
    d = tmp_path_factory.mktemp("pki")
    return d, write_mtls(d)


@pytest.fixture(scope="module")
def eagle3(tiny_root):
    return tiny_dirs(tiny_root, "eagle3")[1]


def test_mtls_alone_refuses_to_start(eagle3, pki):
    _, mtls = pki
    run = _serve(eagle3, *as_flags(mtls.serve()))
    _one_line(run, "--insecure-zmq", "--transports")


def test_curve_without_a_client_allow_list_refuses_to_start(eagle3, pki):
    d, mtls = pki
    curve = write_curve(d)
    run = _serve(eagle3, *as_flags(mtls.serve()), "--curve-server-cert", curve.keys["server"][1])
    _one_line(run, "--curve-clients-dir")


def test_insecure_zmq_is_explicit_and_logged(eagle3, pki, tmp_path, one_torch_thread):
    _, mtls = pki
    log = tmp_path / "server.log"
    with DrafterServer(eagle3, "eagle3", log_path=log, kv_blocks=64, block_sizes=16, **mtls.serve(),
                       insecure_zmq="true", **SERVER_SETTINGS) as server:
        with ZmqDrafterClient(server.zmq_endpoint, timeout_s=10) as c:
            assert c.info().method == "eagle3"
    warnings = [json.loads(ln) for ln in log.read_text().splitlines() if "insecure_transport" in ln]
    assert [w["transport"] for w in warnings] == ["zmq"] and warnings[0]["level"] == "warning"


def test_a_transport_can_be_turned_off(eagle3, pki, tmp_path, one_torch_thread):
    _, mtls = pki
    with DrafterServer(eagle3, "eagle3", log_path=tmp_path / "server.log", kv_blocks=64, block_sizes=16,
                       **mtls.serve(), transports="grpc", **SERVER_SETTINGS) as server:
        assert "zmq_port" not in server.ready
        with GrpcDrafterClient(server.grpc_target, tls=mtls.client("target-worker"), timeout_s=10) as c:
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
    auth = write_auth(d)
    with DrafterServer(eagle3, "eagle3", log_path=d / "server.log", kv_blocks=64, block_sizes=16, **auth.serve(),
                       max_sessions_per_client=2, **SERVER_SETTINGS) as server:
        yield server, auth


def _grpc_as(server, auth, name):
    return GrpcDrafterClient(server.grpc_target, tls=auth.mtls.client(name), timeout_s=10)


def test_a_session_is_detached_only_by_the_peer_that_attached_it(both_auth):
    from drafter.wire.errors import Code, DrafterError
    from tests.support.servers import layout_for

    server, auth = both_auth
    with _grpc_as(server, auth, "owner") as owner, _grpc_as(server, auth, "other") as other, \
            ZmqDrafterClient(server.zmq_endpoint, timeout_s=10, curve=auth.curve.config()) as zmq_peer:
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

    server, auth = both_auth
    clients = [_grpc_as(server, auth, "greedy") for _ in range(3)]
    try:
        layout = layout_for(clients[0].info(), 4)
        clients[0].attach(layout)
        clients[1].attach(layout)
        with pytest.raises(DrafterError) as e:
            clients[2].attach(layout)
        assert (e.value.code, e.value.field) == (Code.RESOURCE_EXHAUSTED, "session")
        with _grpc_as(server, auth, "modest") as modest:  # another client still gets one
            modest.attach(layout)
            modest.detach()
        for c in clients[:2]:
            c.detach()
    finally:
        for c in clients:
            c.close()
