"""The plugin and vLLM 0.32's speculative method "mtp": what each runner builds, and the refusal.

vLLM's V1 runner drafts a DeepSeek MTP checkpoint with EagleProposer at MTP layer 0 every step
(first_layer); Model Runner V2 builds MultiModuleMTPSpeculator when min(n, k) > 1 (multi_module),
else MTPSpeculator (first_layer).  The plugin stands in for none of them: remote drafting configured
with method mtp stops vLLM before anything is built, naming what the runner would build and what the
drafter can or cannot compute for it.  With vLLM's own config objects: test_vllm_mtp_runners.py.
"""

from __future__ import annotations

import types

import pytest

from drafter_vllm.install import patch_v1_runner_module, patch_v2_runner_module
from drafter_vllm.plan import (RUNNER_V1, RUNNER_V2, RemoteDraftingBypassed, drafting_plan,
                               mtp_layer_schedule_of)

REMOTE = {"drafter": {"endpoints": "h:1"}}


def _config(*, v2: bool, multi_module: bool = False, step3p5: bool = False):
    spec = types.SimpleNamespace(method="mtp", use_multi_module_mtp=lambda: multi_module,
                                 use_step3p5_mtp=lambda: step3p5)
    return types.SimpleNamespace(speculative_config=spec, additional_config=REMOTE, use_v2_model_runner=v2)


@pytest.mark.parametrize("cfg,runner,schedule,builds", [
    (_config(v2=False), RUNNER_V1, "first_layer", "vllm.v1.spec_decode.eagle.EagleProposer"),
    (_config(v2=False, step3p5=True), RUNNER_V1, "per_step", "Step3p5MTPProposer"),
    (_config(v2=True), RUNNER_V2, "first_layer", "mtp.speculator.MTPSpeculator"),
    (_config(v2=True, multi_module=True), RUNNER_V2, "multi_module", "MultiModuleMTPSpeculator"),
], ids=["v1", "v1-step3p5", "mrv2-one-module", "mrv2-multi-module"])
def test_each_runner_s_mtp_drafter_and_its_layer_schedule(cfg, runner, schedule, builds):
    assert mtp_layer_schedule_of(cfg) == schedule
    plan = drafting_plan(cfg)
    assert plan.runner == runner and builds in plan.builds and plan.stand_in is None


def test_mrv2_multi_module_is_refused_before_it_is_built(monkeypatch):
    monkeypatch.delenv("DRAFTER_ENDPOINTS", raising=False)
    monkeypatch.delenv("DRAFTER_TRANSPORT", raising=False)
    built = []
    module = types.SimpleNamespace(init_speculator=lambda cfg, device, req_states: built.append(cfg))
    patch_v2_runner_module(module)
    with pytest.raises(RemoteDraftingBypassed) as err:
        module.init_speculator(_config(v2=True, multi_module=True), "cpu", None)
    text = str(err.value)
    assert "MultiModuleMTPSpeculator" in text and "'multi_module' is refused" in text and not built


def test_v1_mtp_is_refused_naming_what_the_drafter_computes_for_it(monkeypatch):
    monkeypatch.delenv("DRAFTER_ENDPOINTS", raising=False)
    monkeypatch.delenv("DRAFTER_TRANSPORT", raising=False)

    class GPUModelRunner:
        def __init__(self, vllm_config, device):
            self.drafter = object()

    patch_v1_runner_module(types.SimpleNamespace(GPUModelRunner=GPUModelRunner))
    with pytest.raises(RemoteDraftingBypassed) as err:
        GPUModelRunner(_config(v2=False), "cpu")
    text = str(err.value)
    assert "EagleProposer (MTP layer 0 at every draft step)" in text
    assert "--method deepseek_mtp --mtp-layer-schedule first_layer" in text
