"""The target side's auth settings (issue 19 item 3, the client half): ServiceTransport takes CURVE
keys for a zmq endpoint and TLS files for a grpc one, and the vLLM plugin's settings carry them,
refusing by name a setting of the other scheme, half of a pair, or a file that is not there."""

from __future__ import annotations

import pytest

from coordinator.clients import ServiceTransport
from coordinator.routing import Endpoint
from coordinator.transport import CurveConfig, TlsConfig
from drafter_vllm.settings import PluginSettings
from drafter_vllm.sources import TargetFacts, make_source
from tests.support.auth_material import curve_certificates

FACTS = TargetFacts(method="eagle3", num_speculative_tokens=3, hidden_size=64, num_aux_layers=3, dtype="bfloat16",
                    max_model_len=128, max_num_seqs=8, max_num_batched_tokens=512, block_size=32, num_blocks=128,
                    padded_drafter_batch=True, head_dir="h", target_dir="t", device="cpu", client="/models/t/dp0")
NOWHERE = 9  # the discard port: nothing is sent in these tests, clients connect lazily


@pytest.fixture
def files(tmp_path):
    """CURVE certificates (zmq.auth) and three PEM-named files (their content is read only on connect)."""
    keys = curve_certificates(tmp_path)
    pem = {}
    for name in ("ca", "cert", "key"):
        pem[name] = tmp_path / f"{name}.pem"
        pem[name].write_text("-----BEGIN PLACEHOLDER-----\n")
    return {"server_public": keys["server"][0], "client_secret": keys["client"][1],
            "client_public": keys["client"][0], **{k: str(v) for k, v in pem.items()}}


def _env(transport: str, **settings) -> dict:
    return {"DRAFTER_ENDPOINTS": f"127.0.0.1:{NOWHERE}", "DRAFTER_TRANSPORT": transport,
            **{f"DRAFTER_{k.upper()}": v for k, v in settings.items()}}


def _refused(environ: dict, additional_config=None) -> str:
    with pytest.raises(ValueError) as err:
        PluginSettings.from_sources(environ, additional_config)
    return str(err.value)


# ---------------------------------------------------------------- ServiceTransport
def test_service_transport_hands_each_scheme_its_own_auth(files):
    curve = CurveConfig(server_public=files["server_public"], client_secret=files["client_secret"])
    tls = TlsConfig(files["ca"], files["cert"], files["key"])
    zmq_t = ServiceTransport(Endpoint("zmq", "127.0.0.1", NOWHERE), curve=curve)
    grpc_t = ServiceTransport(Endpoint("grpc", "127.0.0.1", NOWHERE), tls=TlsConfig(files["ca"]))
    try:
        assert zmq_t.client.curve is curve, "the zmq client (and a bound session's sockets) get the keys"
        assert grpc_t.client.tls == TlsConfig(files["ca"])
    finally:
        zmq_t.close()
        grpc_t.close()
    with pytest.raises(ValueError, match=r"^tls is the grpc transport's setting"):
        ServiceTransport(Endpoint("zmq", "127.0.0.1", NOWHERE), tls=tls)
    with pytest.raises(ValueError, match=r"^curve is the zmq transport's setting"):
        ServiceTransport(Endpoint("grpc", "127.0.0.1", NOWHERE), curve=curve)


# ---------------------------------------------------------------- PluginSettings
def test_the_environment_and_additional_config_carry_the_auth_settings(files):
    s = PluginSettings.from_sources(_env("zmq", curve_server_public=files["server_public"],
                                         curve_client_secret=files["client_secret"]), None)
    assert s.curve_config() == CurveConfig(server_public=files["server_public"], client_secret=files["client_secret"])
    assert s.tls_config() is None
    extra = {"drafter": {"transport": "grpc", "tls_root_ca": files["ca"], "tls_cert": files["cert"],
                         "tls_key": files["key"], "tls_server_name": "drafter.internal"}}
    s = PluginSettings.from_sources(_env("zmq"), extra)
    assert s.tls_config() == TlsConfig(files["ca"], files["cert"], files["key"], "drafter.internal")
    assert s.curve_config() is None
    assert PluginSettings.from_sources(_env("grpc", tls_root_ca=files["ca"]), None).tls_config() == \
        TlsConfig(files["ca"]), "TLS without a client certificate: encryption, for a drafter without mTLS"
    plain = PluginSettings.from_sources(_env("zmq"), None)
    assert plain.curve_config() is None and plain.tls_config() is None


def test_make_source_connects_with_the_settings_auth(files):
    s = PluginSettings.from_sources(_env("zmq", curve_server_public=files["server_public"],
                                         curve_client_secret=files["client_secret"]), None)
    t = make_source(s, FACTS).connect(Endpoint("zmq", "127.0.0.1", NOWHERE))
    try:
        assert t.client.curve == s.curve_config()
    finally:
        t.close()
    s = PluginSettings.from_sources(_env("grpc", tls_root_ca=files["ca"], tls_cert=files["cert"],
                                         tls_key=files["key"]), None)
    t = make_source(s, FACTS).connect(Endpoint("grpc", "127.0.0.1", NOWHERE))
    try:
        assert t.client.tls == s.tls_config()
    finally:
        t.close()


@pytest.mark.parametrize("transport, setting", [
    ("grpc", "curve_server_public"), ("grpc", "curve_client_secret"),
    ("zmq", "tls_root_ca"), ("zmq", "tls_cert"), ("zmq", "tls_key"), ("zmq", "tls_server_name"),
    ("inprocess", "curve_server_public"), ("inprocess", "tls_root_ca")])
def test_a_setting_of_the_other_scheme_is_refused_by_name(files, transport, setting):
    value = {"curve_server_public": files["server_public"], "curve_client_secret": files["client_secret"],
             "tls_root_ca": files["ca"], "tls_cert": files["cert"], "tls_key": files["key"],
             "tls_server_name": "localhost"}[setting]
    message = _refused(_env(transport, **{setting: value}))
    assert message.startswith(f"DRAFTER_{setting.upper()} (additional_config drafter.{setting}) is a setting of"), \
        message
    assert _refused(_env("zmq"), {"drafter": {"transport": transport, setting: value}}) == message


@pytest.mark.parametrize("given, missing", [
    ({"curve_server_public": "server_public"}, "curve_client_secret"),
    ({"curve_client_secret": "client_secret"}, "curve_server_public"),
    ({"tls_root_ca": "ca", "tls_cert": "cert"}, "tls_key"),
    ({"tls_root_ca": "ca", "tls_key": "key"}, "tls_cert"),
    ({"tls_cert": "cert", "tls_key": "key"}, "tls_root_ca"),
    ({"tls_server_name": None}, "tls_root_ca")])
def test_half_a_pair_is_refused_naming_the_missing_half(files, given, missing):
    settings = {k: files[v] if v else "localhost" for k, v in given.items()}
    transport = "zmq" if missing.startswith("curve") else "grpc"
    message = _refused(_env(transport, **settings))
    assert f"needs DRAFTER_{missing.upper()} (additional_config drafter.{missing}) too" in message, message


def test_a_missing_or_wrong_file_is_refused_by_name(files, tmp_path):
    gone = str(tmp_path / "gone.pem")
    message = _refused(_env("grpc", tls_root_ca=files["ca"], tls_cert=gone, tls_key=files["key"]))
    assert message.startswith("DRAFTER_TLS_CERT (additional_config drafter.tls_cert): no such file"), message
    message = _refused(_env("zmq", curve_server_public=files["server_public"],
                            curve_client_secret=files["client_public"]))
    assert message.startswith("DRAFTER_CURVE_CLIENT_SECRET (additional_config drafter.curve_client_secret): ") \
        and "holds no secret key" in message, message
    message = _refused(_env("zmq", curve_server_public=files["ca"], curve_client_secret=files["client_secret"]))
    assert message.startswith("DRAFTER_CURVE_SERVER_PUBLIC (additional_config drafter.curve_server_public): "
                              "not a zmq.auth certificate"), message
    message = _refused(_env("grpc"), {"drafter": {"tls_root_ca": 7}})
    assert message.startswith("DRAFTER_TLS_ROOT_CA (additional_config drafter.tls_root_ca) must be a string"), message
