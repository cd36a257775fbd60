"""The target side under auth (issue 19 item 3, the client half): the vLLM plugin's RemoteProposer
reaches a drafter that requires CURVE on ZMQ and mTLS on gRPC.

One `drafter serve` on loopback with both (certificates and keys generated in a temporary
directory, one client key on the CURVE allow list).  Through drafter_vllm's own path (PluginSettings
-> make_source -> RemoteProposer over ServiceTransport), a target with the keys drafts what an
in-process engine drafts, over ZMQ (its bound session's own control socket speaking CURVE with the
same keys: the drafter answers its Bind) and over gRPC; one with a key not on the list, or without a
client certificate, gets no drafts: the attach fails within its deadline and every step returns None.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

from coordinator.transport import TlsConfig
from drafter_vllm.settings import PluginSettings
from drafter_vllm.sources import TargetFacts, make_source
from tests.integration.conftest import MAX_NUM_SEQS, MAX_TOKENS, MML, SERVER_SETTINGS, SESSION_BLOCKS, \
    reference_engine
from tests.integration.test_service_parity import plans, scenario
from tests.support.auth_material import AuthMaterial, write_auth
from tests.support.engines import tiny_dirs
from tests.support.servers import DrafterServer

STEPS = 3  # of test_service_parity's decode: prefills over several blocks, then rejections
FAIL_DEADLINE_MS = 500.0  # a target without the right keys waits this long per attach, then steps on


@dataclass(frozen=True)
class Secured:
    server: DrafterServer
    root: object  # tiny_root
    auth: AuthMaterial  # the drafter's: its CA and certificate, the CURVE key pairs and allow list
    tls: TlsConfig  # the target's: that CA, its client certificate and key

    def curve(self, client: str) -> dict[str, str]:
        """The plugin's CURVE settings presenting `client`'s key pair."""
        return {"curve_server_public": self.auth.curve.keys["server"][0],
                "curve_client_secret": self.auth.curve.keys[client][1]}


@pytest.fixture(scope="module")
def secured(tiny_root, tmp_path_factory, one_torch_thread):
    d = tmp_path_factory.mktemp("client-auth")
    auth = write_auth(d)
    tls = auth.mtls.client("target-worker")
    _, model = tiny_dirs(tiny_root, "eagle3")
    with DrafterServer(model, "eagle3", log_path=d / "server.log", kv_blocks=4 * SESSION_BLOCKS, block_sizes=16,
                       **auth.serve(), **SERVER_SETTINGS) as server:
        yield Secured(server, tiny_root, auth, tls)


def _facts(secured: Secured, ref, name: str) -> TargetFacts:
    head, target = (str(p) for p in _dirs(secured.root))
    return TargetFacts(method="eagle3", num_speculative_tokens=ref.config.num_speculative_tokens,
                       hidden_size=ref.spec.target_width, num_aux_layers=len(ref.spec.aux_layer_ids),
                       dtype="float32", max_model_len=MML, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_TOKENS,
                       block_size=ref.limits.block_sizes[0], num_blocks=SESSION_BLOCKS, padded_drafter_batch=True,
                       head_dir=head, target_dir=target, device="cpu", client=f"client-auth/{name}")


def _dirs(root):
    _, out = tiny_dirs(root, "eagle3")
    return out / "head", out / "target"


def _settings(secured: Secured, transport: str, deadline_ms: float, **auth) -> PluginSettings:
    """The plugin's settings as a vLLM worker reads them: its environment."""
    address = secured.server.zmq_endpoint if transport == "zmq" else secured.server.grpc_target
    env = {"DRAFTER_ENDPOINTS": address, "DRAFTER_TRANSPORT": transport, "DRAFTER_DEADLINE_MS": str(deadline_ms),
           **{f"DRAFTER_{k.upper()}": v for k, v in auth.items()}}
    return PluginSettings.from_env(env)


def _drafts_like_in_process(secured: Secured, settings: PluginSettings, name: str) -> None:
    ref = reference_engine(secured.root, "eagle3")
    assert len(ref.limits.block_sizes) == 1, "one KV group, as the server serves"
    source = make_source(settings, _facts(secured, ref, name))
    s_ref, s_remote = scenario(ref, seed=1), scenario(ref, seed=1)
    try:
        assert source.start(), f"attached: {list(source.events)}"
        for plan in list(plans())[:STEPS]:
            expected = ref.propose(**s_ref.call(plan).kwargs).draft_token_ids
            got = source.propose(**s_remote.call(plan).kwargs)
            assert got is not None, f"no drafts: {source.stats.no_drafts}"
            assert torch.equal(got, expected), (plan, got, expected)
    finally:
        source.close(timeout=5.0)


def _fails_closed(secured: Secured, settings: PluginSettings, name: str, reasons: set[str]) -> None:
    """No session, no drafts, and no call that came back past its deadline (the transport's timeout
    is the step's deadline: a refused handshake is a missed deadline or a refusal, never a hang)."""
    assert (settings.curve_config() or settings.tls_config()) is not None, "the target presents its own auth"
    ref = reference_engine(secured.root, "eagle3")
    source = make_source(settings, _facts(secured, ref, name))
    try:
        assert not source.start(), "an unauthenticated target attached"
        assert source.propose(**scenario(ref, seed=2).call(list(plans())[0]).kwargs) is None
        assert set(source.stats.no_drafts) & reasons, source.stats.no_drafts
        assert source.stats.late == 0 and source.session is None
        print(f"\n[client auth] {name}: the longest wait {source.stats.max_wait_s * 1000:.0f} ms against a "
              f"{settings.deadline_ms:.0f} ms deadline; {source.stats.no_drafts}")
    finally:
        source.close(timeout=1.0)


def test_the_plugin_drafts_over_zmq_with_curve(secured, caplog):
    settings = _settings(secured, "zmq", 30_000, **secured.curve("client"))
    caplog.set_level(logging.WARNING, logger="coordinator")
    _drafts_like_in_process(secured, settings, "zmq")
    # the bound session's control socket (its own ZMQ context) spoke CURVE with the same keys: the
    # drafter answered its Bind, refusing it only for this CPU drafter's engine (no CUDA graphs)
    refusals = [r.getMessage() for r in caplog.records if "stays unbound" in r.getMessage()]
    assert len(refusals) == 1 and "INVALID_ARGUMENT engine" in refusals[0], refusals


def test_the_plugin_drafts_over_grpc_with_mtls(secured):
    settings = _settings(secured, "grpc", 30_000, tls_root_ca=secured.tls.root_ca, tls_cert=secured.tls.cert,
                         tls_key=secured.tls.key)
    _drafts_like_in_process(secured, settings, "grpc")


def test_a_key_not_on_the_allow_list_gets_no_drafts(secured):
    settings = _settings(secured, "zmq", FAIL_DEADLINE_MS, **secured.curve("intruder"))
    _fails_closed(secured, settings, "intruder", {"attach DEADLINE_EXCEEDED"})


def test_tls_without_a_client_certificate_gets_no_drafts(secured):
    settings = _settings(secured, "grpc", FAIL_DEADLINE_MS, tls_root_ca=secured.tls.root_ca)
    _fails_closed(secured, settings, "no-cert", {"attach UNAVAILABLE", "attach DEADLINE_EXCEEDED"})
