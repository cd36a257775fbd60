"""The vLLM plugin's parts that need no vLLM: settings, version gate, fail-closed drafts, the class hook.

Everything that needs a real vLLM runs in tests/vllm_parity/test_plugin.py.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import drafter_vllm
from drafter_vllm.compat import UnsupportedVLLM, check_vllm_version
from drafter_vllm.fallback import fallback_drafts, usable_drafts
from drafter_vllm.install import patch_module, patch_v1_runner_module, patch_v2_runner_module
from drafter_vllm.plan import (RUNNER_V1, RUNNER_V2, STAND_IN, VLLM_DRAFTER, RemoteDraftingBypassed,
                               drafting_plan)
from drafter_vllm.settings import PluginSettings


# ---------------------------------------------------------------- settings
def test_not_configured_is_inert():
    s = PluginSettings.from_env({})
    assert not s.enabled and s.transport == "zmq" and s.deadline_ms == 50.0


def test_env_as_the_k8s_overlay_sets_it():
    s = PluginSettings.from_env({"DRAFTER_ENDPOINTS": "drafter.ns.svc:5555, other:5555",
                                 "DRAFTER_TRANSPORT": "zmq", "DRAFTER_DEADLINE_MS": "50"})
    assert s.enabled
    assert s.endpoints == ("drafter.ns.svc:5555", "other:5555")
    assert s.deadline_s == 0.05


@pytest.mark.parametrize("written", ["h:50051", "grpc://h:50051", "tcp://h:50051"])
def test_endpoints_are_host_port_whatever_the_prefix(written):
    s = PluginSettings.from_env({"DRAFTER_ENDPOINTS": written, "DRAFTER_TRANSPORT": "GRPC"})
    assert s.endpoints == ("h:50051",) and s.transport == "grpc"


def test_additional_config_wins_key_by_key():
    s = PluginSettings.from_sources({"DRAFTER_ENDPOINTS": "a:1", "DRAFTER_DEADLINE_MS": "80"},
                                    {"drafter": {"endpoints": ["b:2"], "transport": "grpc"}})
    assert s.endpoints == ("b:2",) and s.transport == "grpc" and s.deadline_ms == 80.0


def test_inprocess_needs_no_endpoint():
    assert PluginSettings.from_env({"DRAFTER_TRANSPORT": "inprocess"}).enabled


@pytest.mark.parametrize("env, field", [
    ({"DRAFTER_ENDPOINTS": "nohost"}, "host:port"),
    ({"DRAFTER_ENDPOINTS": "h:1", "DRAFTER_TRANSPORT": "carrier-pigeon"}, "DRAFTER_TRANSPORT"),
    ({"DRAFTER_ENDPOINTS": "h:1", "DRAFTER_DEADLINE_MS": "soon"}, "DRAFTER_DEADLINE_MS"),
    ({"DRAFTER_ENDPOINTS": "h:1", "DRAFTER_DEADLINE_MS": "0"}, "DRAFTER_DEADLINE_MS"),
])
def test_bad_settings_name_the_variable(env, field):
    with pytest.raises(ValueError, match=field):
        PluginSettings.from_env(env)


def test_unknown_additional_config_key_is_refused():
    with pytest.raises(ValueError, match="endpoint"):
        PluginSettings.from_sources({}, {"drafter": {"endpoint": "a:1"}})


# ---------------------------------------------------------------- version gate
@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.32.2rc1"])
def test_supported_versions(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "0.3.2"])
def test_other_versions_are_refused_clearly(version):
    with pytest.raises(UnsupportedVLLM, match=r"supports vLLM 0\.32\.x, not " + version.replace(".", r"\.")):
        check_vllm_version(version)


def _fake_vllm(monkeypatch, version):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))


def test_register_on_unsupported_vllm_raises_only_when_configured(monkeypatch):
    _fake_vllm(monkeypatch, "0.33.0")
    monkeypatch.delenv("DRAFTER_ENDPOINTS", raising=False)
    monkeypatch.delenv("DRAFTER_TRANSPORT", raising=False)
    drafter_vllm.register()  # installed but unused: vLLM must start as if the plugin were absent
    monkeypatch.setenv("DRAFTER_ENDPOINTS", "h:5555")
    with pytest.raises(UnsupportedVLLM, match="0.33.0"):
        drafter_vllm.register()


# ---------------------------------------------------------------- fail-closed drafts
def test_fallback_repeats_the_next_token():
    d = fallback_drafts(torch.tensor([5, 7], dtype=torch.int32), 3)
    assert d.dtype == torch.int64 and d.tolist() == [[5, 5, 5], [7, 7, 7]]


@pytest.mark.parametrize("drafts, why", [
    (None, "not a tensor"),
    (torch.zeros(3, 3, dtype=torch.int64), "shape"),
    (torch.zeros(2, 2, dtype=torch.int64), "shape"),
    (torch.zeros(2, 3), "dtype"),
    (torch.tensor([[0, 1, 512], [0, 0, 0]]), "outside"),
    (torch.tensor([[0, -1, 5], [0, 0, 0]]), "outside"),
])
def test_unusable_drafts_are_named(drafts, why):
    assert why in usable_drafts(drafts, batch=2, k=3, vocab_size=512)


def test_usable_drafts():
    assert usable_drafts(torch.tensor([[0, 1, 511], [3, 4, 5]]), batch=2, k=3, vocab_size=512) is None
    # a session attached with a larger k serves a step that asks for fewer
    assert usable_drafts(torch.zeros(2, 4, dtype=torch.int64), batch=2, k=3, vocab_size=512) is None


# ---------------------------------------------------------------- the class hook
def _fake_eagle_module():
    class EagleProposer:
        def __init__(self, vllm_config, device, runner=None):
            self.vllm_config = vllm_config

    class DFlashLike(EagleProposer):
        pass

    return types.SimpleNamespace(EagleProposer=EagleProposer, DFlashLike=DFlashLike)


def _config(method="eagle3", additional=None, v2=False):
    spec = types.SimpleNamespace(method=method, use_multi_module_mtp=lambda: False, use_step3p5_mtp=lambda: False)
    return types.SimpleNamespace(speculative_config=spec,
                                 additional_config=additional or {}, use_v2_model_runner=v2)


def test_hook_leaves_vllm_alone_when_not_configured(monkeypatch):
    monkeypatch.delenv("DRAFTER_ENDPOINTS", raising=False)
    monkeypatch.delenv("DRAFTER_TRANSPORT", raising=False)
    mod = _fake_eagle_module()
    patch_module(mod)
    patch_module(mod)  # vLLM may load plugins more than once
    p = mod.EagleProposer(_config(), "cpu")
    assert type(p) is mod.EagleProposer and p.vllm_config.speculative_config.method == "eagle3"
    assert type(mod.DFlashLike(_config(additional={"drafter": {"transport": "inprocess"}}), "cpu")) is mod.DFlashLike


@pytest.mark.parametrize("v2, runner", [(False, "V1 model runner"), (True, "Model Runner V2")])
def test_hook_refuses_methods_the_drafter_cannot_stand_in_for(monkeypatch, v2, runner):
    mod = _fake_eagle_module()
    patch_module(mod)
    with pytest.raises(RemoteDraftingBypassed,
                       match=f"vLLM's {runner} drafts speculative method 'mtp'.*'eagle' or 'eagle3'"):
        mod.EagleProposer(_config("mtp", {"drafter": {"endpoints": "h:1"}}, v2=v2), "cpu")


# ---------------------------------------------------------------- runner + drafting class: never bypassed
def _stand_in(qualified: str):
    module, name = qualified.rsplit(".", 1)
    return type(name, (), {"__module__": module, "__qualname__": name})()


REMOTE = {"drafter": {"endpoints": "h:1"}}


@pytest.mark.parametrize("v2", [False, True])
def test_plan_names_runner_vllm_class_and_stand_in(v2):
    plan = drafting_plan(_config("eagle", REMOTE, v2=v2))
    assert plan.runner == (RUNNER_V2 if v2 else RUNNER_V1)
    assert plan.builds == VLLM_DRAFTER[plan.runner] and plan.stand_in == STAND_IN[plan.runner]
    assert drafting_plan(_config("ngram", REMOTE, v2=v2)).stand_in is None


def test_mrv2_init_speculator_is_checked(monkeypatch):
    """Model Runner V2's construction of its speculator, hooked: the stand-in passes, anything else
    with remote drafting configured stops vLLM naming the runner; without it nothing is checked."""
    monkeypatch.delenv("DRAFTER_ENDPOINTS", raising=False)
    monkeypatch.delenv("DRAFTER_TRANSPORT", raising=False)
    built = {}
    module = types.SimpleNamespace(init_speculator=lambda cfg, device, req_states: built["obj"])
    patch_v2_runner_module(module)
    patch_v2_runner_module(module)  # idempotent
    built["obj"] = _stand_in(STAND_IN[RUNNER_V2])
    assert module.init_speculator(_config("eagle3", REMOTE, v2=True), "cpu", None) is built["obj"]
    built["obj"] = _stand_in("vllm.v1.worker.gpu.spec_decode.eagle.speculator.EagleSpeculator")
    with pytest.raises(RemoteDraftingBypassed) as e:
        module.init_speculator(_config("eagle3", REMOTE, v2=True), "cpu", None)
    assert "Model Runner V2 builds vllm.v1.worker.gpu.spec_decode.eagle.speculator.EagleSpeculator" in str(e.value)
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in str(e.value)
    assert module.init_speculator(_config("eagle3", v2=True), "cpu", None) is built["obj"]  # not configured


def test_v1_runner_checks_its_drafter(monkeypatch):
    monkeypatch.delenv("DRAFTER_ENDPOINTS", raising=False)
    monkeypatch.delenv("DRAFTER_TRANSPORT", raising=False)

    class GPUModelRunner:
        drafter_class = None

        def __init__(self, vllm_config, device):
            self.drafter = None if self.drafter_class is None else _stand_in(self.drafter_class)

    module = types.SimpleNamespace(GPUModelRunner=GPUModelRunner)
    patch_v1_runner_module(module)
    GPUModelRunner.drafter_class = STAND_IN[RUNNER_V1]
    GPUModelRunner(_config("eagle", REMOTE), "cpu")
    GPUModelRunner.drafter_class = "vllm.v1.spec_decode.ngram_proposer.NgramProposer"
    with pytest.raises(RemoteDraftingBypassed, match="V1 model runner builds vllm.v1.spec_decode.ngram_proposer"):
        GPUModelRunner(_config("eagle", REMOTE), "cpu")
    with pytest.raises(RemoteDraftingBypassed, match="'ngram'"):  # refused before anything is built
        GPUModelRunner(_config("ngram", REMOTE), "cpu")
    GPUModelRunner(_config("ngram"), "cpu")  # not configured: vLLM's own drafter, unchecked
