"""The tools that act as a target reach a drafter that requires auth (issue 19 item 3): `drafter
loadtest` with --curve-* (zmq, its --predraft mode too) and --tls-* (grpc), and the fleet's
connections (coordinator.demo.fleet.FleetConfig.auth).

One `drafter serve` on loopback with CURVE (one client key on the allow list) and mTLS
(tests.integration.test_client_auth's `secured`).  Each tool with the client's keys is served; without
them it gets no answer and says so.  The flags are checked at the edge: a file that is not there,
half a pair, a setting of a transport the run does not use, each refused naming the flag.
"""

from __future__ import annotations

import json

import pytest

from coordinator.client_auth import ClientAuth
from coordinator.loadtest import cli
from coordinator.routing import Endpoint
from tests.integration.test_client_auth import secured  # noqa: F401 - the module's drafter (a fixture)
from tests.support.auth_material import as_flags

# per-call deadline 30 s: the runs assert zero errors (auth admitted them), not a speed; on a starved box an open
# loop's backlog must still be answered within it (the refused runs fail at the handshake, not on the clock)
RUN = ["--device", "cpu", "--rate", "4", "--duration", "1.5", "--warmup", "0.25", "--timeout", "30", "--dp", "1",
       "--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--prompt-len", "uniform:4:12",
       "--output-len", "uniform:2:6", "--prefill-chunk", "16", "--quiet", "--no-plot"]


def _curve(s) -> list[str]:
    return as_flags(s.curve("client"))


def _tls(s) -> list[str]:
    return ["--tls-root-ca", s.tls.root_ca, "--tls-cert", s.tls.cert, "--tls-key", s.tls.key]


def _served(out, name: str) -> dict:
    summ = json.loads((out / f"{name}.json").read_text())["summary"]
    assert summ["ok"] > 0 and summ["errors"] == 0, summ
    return summ


def test_loadtest_over_zmq_with_curve(secured, tmp_path, capsys):  # noqa: F811
    """Without the keys the handshake never completes: the run waits out its 10 s Info and exits 1, the
    same path as grpc's refusal below (left out here for the suite's time)."""
    ep = secured.server.zmq_endpoint
    assert cli.main(["--endpoint", ep, "--transport", "zmq", *_curve(secured), "--out", str(tmp_path / "a"),
                     *RUN]) == 0, capsys.readouterr().err
    _served(tmp_path / "a", "zmq-open-4")


def test_loadtest_over_grpc_with_mtls_and_not_without(secured, tmp_path, capsys):  # noqa: F811
    ep = secured.server.grpc_target
    assert cli.main(["--endpoint", ep, "--transport", "grpc", *_tls(secured), "--out", str(tmp_path / "a"),
                     *RUN]) == 0, capsys.readouterr().err
    _served(tmp_path / "a", "grpc-open-4")
    rc = cli.main(["--endpoint", ep, "--transport", "grpc", "--tls-root-ca", secured.tls.root_ca, "--out",
                   str(tmp_path / "b"), *RUN])  # TLS without a client certificate: mTLS refuses it
    err = capsys.readouterr().err
    assert rc == 1 and "did not answer Info" in err, err


def test_loadtest_predraft_over_zmq_with_curve(secured, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "p"
    rc = cli.main(["--predraft", "--endpoint", secured.server.zmq_endpoint, *_curve(secured), "--verify-ms", "5",
                   "--predraft-batch", "2", "--out", str(out), *RUN])
    assert rc == 0, capsys.readouterr()
    runs = json.loads((out / "predraft.json").read_text())["runs"]
    assert [r["errors"] for r in runs] == [[], []] and all(r["steps_per_s"] > 0 for r in runs), runs


def test_the_fleet_connects_with_its_auth(secured):  # noqa: F811
    """FleetConfig.auth reaches every ServiceTransport the fleet's ranks make: Info is answered over
    zmq with the CURVE keys and over grpc with mTLS, and not without them."""
    from coordinator.demo.fleet import make_connect
    from drafter.wire.errors import DrafterError

    auth = ClientAuth(curve=secured.auth.curve.config(), tls=secured.tls)
    zmq_ep = Endpoint.parse("zmq://" + secured.server.zmq_endpoint.removeprefix("tcp://"))
    grpc_ep = Endpoint.parse("grpc://" + secured.server.grpc_target)
    for ep in (zmq_ep, grpc_ep):
        t = make_connect(None, None, auth)(ep)
        try:
            assert t.client.info(timeout=10.0).state == "serving"
        finally:
            t.close()
        t = make_connect(None, None)(ep)
        try:
            with pytest.raises(DrafterError):
                t.client.info(timeout=1.0)
        finally:
            t.close()


@pytest.mark.parametrize("argv, word", [
    (["--transport", "zmq", "--curve-server-public", "/nonexistent/server.key", "--curve-client-secret",
      "/nonexistent/client.key_secret"], "--curve-server-public: no such file"),
    (["--transport", "zmq", "--curve-server-public", "/nonexistent/server.key"], "--curve-server-public needs "
                                                                                "--curve-client-secret"),
    (["--transport", "grpc", "--tls-cert", "c.pem", "--tls-key", "k.pem"], "--tls-cert needs --tls-root-ca"),
    (["--transport", "grpc", "--tls-root-ca", "/nonexistent/ca.pem"], "--tls-root-ca: no such file"),
    (["--transport", "grpc", "--curve-server-public", "s", "--curve-client-secret", "c"],
     "--curve-server-public is a setting of the zmq transport"),
    (["--transport", "zmq", "--tls-root-ca", "ca.pem"], "--tls-root-ca is a setting of the grpc transport"),
])
def test_loadtest_refuses_bad_auth_flags_by_name(argv, word, tmp_path, capsys):
    assert cli.main([*argv, "--endpoint", "127.0.0.1:1", "--out", str(tmp_path / "o"), *RUN]) == 2
    assert word in capsys.readouterr().err


def test_a_curve_file_that_is_no_certificate_or_has_no_secret_is_refused(secured, tmp_path):  # noqa: F811
    import argparse

    bogus = tmp_path / "bogus.key"
    bogus.write_text("not a certificate\n")
    keys = secured.auth.curve.keys
    ns = argparse.Namespace(curve_server_public=str(bogus), curve_client_secret=keys["client"][1])
    with pytest.raises(ValueError, match="--curve-server-public: .* is not a zmq.auth certificate"):
        ClientAuth.from_args(ns, {"zmq"})
    ns = argparse.Namespace(curve_server_public=keys["server"][0], curve_client_secret=keys["client"][0])  # public
    with pytest.raises(ValueError, match="--curve-client-secret: .* holds no secret key"):
        ClientAuth.from_args(ns, {"zmq"})
