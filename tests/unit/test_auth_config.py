"""Auth is all or nothing: a config that leaves one transport open while the other authenticates is refused
at the edge, CURVE needs its allow list, and a transport can be turned off (issue 19, item 3)."""

from __future__ import annotations

import pytest

from drafter.service.config import ServerConfig

BASE = dict(method="eagle3", model="/m")
MTLS = dict(tls_cert="/c.pem", tls_key="/k.pem", tls_client_ca="/ca.pem")
CURVE = dict(curve_server_cert="/s.key_secret", curve_clients_dir="/clients")


def _check(**kw) -> ServerConfig:
    cfg = ServerConfig(**BASE, **kw)
    cfg.check()
    return cfg


def test_mtls_alone_refuses_an_open_zmq():
    with pytest.raises(ValueError, match="insecure-zmq"):
        _check(**MTLS)


def test_curve_alone_refuses_an_open_grpc():
    with pytest.raises(ValueError, match="insecure-grpc"):
        _check(**CURVE)


def test_curve_without_an_allow_list_is_refused():
    with pytest.raises(ValueError, match="curve-clients-dir"):
        _check(**MTLS, curve_server_cert="/s.key_secret")


def test_both_configured_starts():
    assert _check(**MTLS, **CURVE).insecure_transports() == []


def test_explicit_opt_out_is_allowed_and_reported():
    assert _check(**MTLS, insecure_zmq=True).insecure_transports() == ["zmq"]
    assert _check(**CURVE, insecure_grpc=True).insecure_transports() == ["grpc"]


def test_a_transport_turned_off_needs_no_auth():
    cfg = _check(**MTLS, transports="grpc")
    assert cfg.serves_grpc and not cfg.serves_zmq and cfg.insecure_transports() == []
    assert not _check(**CURVE, transports="zmq").serves_grpc


def test_no_auth_at_all_still_starts_on_loopback_defaults():
    assert _check().insecure_transports() == []


@pytest.mark.parametrize("bad", ["", "http", "grpc,udp"])
def test_unknown_transport_names_are_refused(bad):
    with pytest.raises(ValueError, match="transports"):
        _check(transports=bad)


def test_ipc_needs_the_zmq_transport():
    with pytest.raises(ValueError, match="zmq-ipc"):
        _check(transports="grpc", zmq_ipc="/run/drafter/zmq.sock")
