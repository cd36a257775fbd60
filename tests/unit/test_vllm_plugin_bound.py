"""The vLLM plugin's bound-session settings: DRAFTER_BOUND, who copies vLLM's per-step tensors, and
the RemoteProposer config the plugin builds (no vLLM needed)."""

from __future__ import annotations

import pytest

from drafter_vllm.settings import PluginSettings
from drafter_vllm.sources import TargetFacts, make_source

FACTS = TargetFacts(method="eagle3", num_speculative_tokens=3, hidden_size=64, num_aux_layers=3, dtype="bfloat16",
                    max_model_len=128, max_num_seqs=8, max_num_batched_tokens=512, block_size=32, num_blocks=128,
                    padded_drafter_batch=True, head_dir="h", target_dir="t", device="cpu", client="/models/t/dp0")


def test_bound_by_default_over_zmq_and_the_transport_copies_the_inputs():
    s = PluginSettings.from_env({"DRAFTER_ENDPOINTS": "10.0.0.7:5555"})
    assert s.bound == "auto" and s.copies_inputs
    assert make_source(s, FACTS).cfg.bound.mode == "auto"


@pytest.mark.parametrize("env,copies", [({"DRAFTER_BOUND": "off"}, False), ({"DRAFTER_TRANSPORT": "grpc"}, False),
                                        ({"DRAFTER_BOUND": "OFF", "DRAFTER_TRANSPORT": "zmq"}, False)])
def test_unbound_network_calls_get_private_copies_from_the_plugin(env, copies):
    s = PluginSettings.from_env({"DRAFTER_ENDPOINTS": "10.0.0.7:5555", **env})
    assert s.copies_inputs is copies
    if s.transport == "zmq":
        assert make_source(s, FACTS).cfg.bound.mode == "off"


def test_additional_config_sets_bound_and_a_bad_value_names_the_variable():
    s = PluginSettings.from_sources({"DRAFTER_ENDPOINTS": "a:1"}, {"drafter": {"bound": "off"}})
    assert s.bound == "off"
    with pytest.raises(ValueError, match="DRAFTER_BOUND"):
        PluginSettings.from_env({"DRAFTER_ENDPOINTS": "a:1", "DRAFTER_BOUND": "sometimes"})
