"""drafter_vllm.sources: a vLLM worker's settings and facts -> the coordinator's RemoteProposer.

The proposer's policy (deadline, breaker, re-attach) is tested with the coordinator; here: the
session spec the worker attaches with, and where its drafters are looked up.
"""

from __future__ import annotations

import pytest

from coordinator.routing import DnsEndpoints, Endpoint, StaticEndpoints
from drafter.engine.config import KVGroupSpec
from drafter_vllm.settings import PluginSettings
from drafter_vllm.sources import TargetFacts, check_transport, endpoint_source, make_source, serve_flags

FACTS = TargetFacts(method="eagle3", num_speculative_tokens=3, hidden_size=64, num_aux_layers=3, dtype="bfloat16",
                    max_model_len=128, max_num_seqs=8, max_num_batched_tokens=512, block_size=32, num_blocks=128,
                    padded_drafter_batch=True, head_dir="h", target_dir="t", device="cpu", client="/models/t/dp1")


def settings(endpoints=("10.0.0.7:5555",), transport="zmq", deadline_ms=50.0):
    return PluginSettings(endpoints=tuple(endpoints), transport=transport, deadline_ms=deadline_ms)


def test_session_spec_deadline_and_key():
    src = make_source(settings(deadline_ms=80), FACTS)
    spec = src.spec
    assert (spec.method, spec.num_speculative_tokens, spec.hidden_size, spec.num_aux_layers) == ("eagle3", 3, 64, 3)
    assert spec.hidden_width == 192 and spec.dtype == "bfloat16"
    assert (spec.max_model_len, spec.max_num_seqs, spec.max_num_batched_tokens) == (128, 8, 512)
    assert spec.kv_groups == (KVGroupSpec(32, 128),)
    assert src.key == spec.client == "/models/t/dp1"
    assert src.cfg.deadline_s == pytest.approx(0.08)


def test_a_service_name_is_resolved_through_dns():
    source = endpoint_source(settings(["drafter.llm-serving.svc.cluster.local:5555"]))
    assert isinstance(source, DnsEndpoints)
    assert (source.name, source.port, source.scheme) == ("drafter.llm-serving.svc.cluster.local", 5555, "zmq")


def test_addresses_and_lists_are_static():
    source = endpoint_source(settings(["10.0.0.7:50051", "drafter-b:50051"], transport="grpc"))
    assert isinstance(source, StaticEndpoints)
    assert set(source.resolve()) == {Endpoint("grpc", "10.0.0.7", 50051), Endpoint("grpc", "drafter-b", 50051)}
    assert endpoint_source(settings(["[::1]:5555"])).resolve() == (Endpoint("zmq", "::1", 5555),)


def test_inprocess_has_one_local_endpoint():
    assert endpoint_source(settings((), transport="inprocess")).resolve() == (Endpoint("inprocess", "vllm", 0),)


@pytest.mark.parametrize("transport", ["zmq", "grpc", "inprocess"])
def test_transports_import(transport):
    check_transport(settings(transport=transport))


def test_nothing_listening_fails_closed_within_the_deadline():
    src = make_source(settings(["127.0.0.1:9"], transport="grpc", deadline_ms=200), FACTS)
    assert not src.start()
    assert src.propose(next_token_ids=None) is None


def test_serve_flags_match_what_the_engine_attaches_with():
    flags = serve_flags(FACTS).split()
    pairs = dict(zip(flags[::2], flags[1::2]))
    assert pairs == {"--method": "eagle3", "--model": "h", "--target-model": "t", "--num-speculative-tokens": "3",
                     "--max-model-len": "128", "--block-sizes": "32", "--kv-blocks": "128", "--max-num-seqs": "8",
                     "--max-num-batched-tokens": "512"}
    # every flag is one `drafter serve` knows
    from drafter.service.config import ServerConfig
    from dataclasses import fields
    known = {"--" + f.name.replace("_", "-") for f in fields(ServerConfig)}
    assert set(pairs) <= known
