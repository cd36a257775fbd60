"""Replay every proposer call recorded from a real vLLM 0.32 engine into our engine.

The recordings come from scripts/test.sh (stage 2), which builds the vLLM venv inside the clone
and runs record_suite.sh; point DRAFTER_VLLM_RECORDINGS at a suite directory to reuse one.

Where vLLM 0.32 on CPU does something we deliberately do not copy, the comparison says so:
  * the last row of a padded first pass keeps a stale input id from an earlier call in vLLM (we
    write 0); that row is a rejected token, but after vLLM skips the drafter for a step its KV
    can be read, so the replay feeds vLLM's recorded id for that one garbage row;
  * on CPU, vLLM's unpadded path aliases two seq_len tensors, so chain step i >= 2 attends over
    extra unwritten keys (GPU vLLM does not); the replay feeds the seq_lens vLLM's attention
    recorded (`attn_seq_lens`) into those steps, so everything else is compared exactly;
  * after a draft step passes max_model_len vLLM restarts the chain at position 0 and overwrites
    position 1's draft KV; we keep such rows dead, so columns after the first clamp are garbage
    on both sides and not compared.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.engine.engine import DraftEngine
from drafter.models.layers import Attention
from drafter.models.rope import Rope
from drafter.models.spec import HeadConfigError, parse_head

pytestmark = pytest.mark.vllm

ROOT = os.environ.get("DRAFTER_VLLM_RECORDINGS")
# heads with a real rope in their config (record_suite.sh ROPE_HEADS): llama3 / Qwen3 theta / yarn /
# linear in both rope layouts (rope_theta + rope_scaling, transformers-5 rope_parameters), over EAGLE-1,
# EAGLE-3 speculators and SafeAILab EAGLE-3 configs, some with attention + MLP biases, partial rotary
# or head_dim 64
ROPE_RUNS = ("rope-llama3-legacy", "rope-llama3-params", "rope-qwen3-legacy", "rope-qwen3-params", "rope-yarn-legacy",
             "rope-yarn-params", "rope-linear-legacy", "rope-linear-params")
RUNS = ("eagle-padded", "eagle3-padded", "eagle-unpadded", "eagle-aligned-chunked", "eagle3-aligned") + ROPE_RUNS
# fp32 logits of our engine and vLLM's CPU kernels differ by ~1e-5; a wrong rotation by far more
ROPE_LOGIT_TOLERANCE = 1e-3
CASES = Path(__file__).resolve().parents[1] / "fixtures" / "rope_cases.json"


def _run_dir(name: str) -> Path:
    if not ROOT:
        pytest.skip("no vLLM recordings: run scripts/test.sh (stage 2 records them) or set DRAFTER_VLLM_RECORDINGS")
    path = Path(ROOT) / "rec" / name
    if not (path / "manifest.json").exists():
        pytest.fail(f"recording {path} is missing: the vLLM recording stage did not produce it")
    return path


def _engine(manifest: dict, calls: list[dict]) -> DraftEngine:
    max_block = max(int(c["block_table"].max()) for c in calls)
    config = EngineConfig(
        method=manifest["method"], num_speculative_tokens=manifest["k"], max_model_len=manifest["max_model_len"],
        max_num_seqs=max(c["next_token_ids"].shape[0] for c in calls),
        max_num_batched_tokens=max(c["target_token_ids"].shape[0] for c in calls),
        kv_groups=(KVGroupSpec(manifest["block_size"], max_block + 1),),
        padded_drafter_batch=manifest["padded_drafter_batch"])
    return DraftEngine.from_dirs(manifest["head"], manifest["target"], config)


def _stale_last_row(engine: DraftEngine, recorded_first_pass_ids: torch.Tensor):
    """Feed vLLM's stale id for the last row of the first pass (see the module docstring)."""
    load = engine.buffers.load

    def load_with_vllm_last_row(inp, tokens_padded, batch_padded):
        load(inp, tokens_padded, batch_padded)
        n = inp.num_tokens
        sampled = engine.buffers.sample_indices[: inp.batch_size]
        if not bool((sampled == n - 1).any()):
            engine.buffers.input_ids[n - 1] = int(recorded_first_pass_ids[n - 1])

    engine.buffers.load = load_with_vllm_last_row


class RecordedChainSeqLens:
    """Attention backend wrapper: chain steps see the seq_lens vLLM's attention saw."""

    def __init__(self, inner):
        self.inner = inner
        self.recorded = None  # [k - 1, batch] int32
        self.forward_index = 0

    def start_call(self, recorded: torch.Tensor | None) -> None:
        self.recorded, self.forward_index = recorded, 0

    def forward(self, q, k, v, kv_cache, meta, sliding_window=None):
        step, self.forward_index = self.forward_index, self.forward_index + 1
        if step > 0 and self.recorded is not None:
            seq_lens = meta.seq_lens.clone()
            seq_lens[: self.recorded.shape[1]] = self.recorded[step - 1]
            meta.seq_lens = seq_lens
        return self.inner.forward(q, k, v, kv_cache, meta, sliding_window)


def _comparable_columns(call: dict, k: int, max_model_len: int) -> torch.Tensor:
    """[batch] leading draft columns both engines define: up to and including the first clamped step."""
    qsl = call["query_start_loc"].long()
    sample = call.get("token_indices_to_sample")
    sample = qsl[1:] - 1 if sample is None else sample.long()
    last_pos = call["target_positions"][sample]
    return (max_model_len - last_pos).clamp(max=k)


def _replay(name: str, engine: DraftEngine | None = None, check_drafts: bool = True,
            max_calls: int | None = None) -> tuple[int, float]:
    """Feed the recorded calls of run `name` (the first max_calls, or all) to one engine in order:
    (drafts compared, largest |logit difference| over the compared columns).  check_drafts: assert
    equal drafts per row."""
    manifest, calls = _manifest_and_calls(name)
    manifest["calls"], calls = manifest["calls"][:max_calls], calls[:max_calls]
    engine = engine or _engine(manifest, calls)
    k, mml, padded = manifest["k"], manifest["max_model_len"], manifest["padded_drafter_batch"]
    d2t = getattr(engine.head, "d2t", None)
    seq_lens_patch = None
    if not padded:
        seq_lens_patch = RecordedChainSeqLens(engine.proposer.backend)
        engine.proposer.backend = seq_lens_patch
    compared = worst_logit = 0.0
    for meta, call in zip(manifest["calls"], calls):
        engine.buffers.__dict__.pop("load", None)  # undo the previous call's patch
        if "fwd0.input_ids" in call:
            _stale_last_row(engine, call["fwd0.input_ids"])
        if seq_lens_patch is not None:
            seq_lens_patch.start_call(call["attn_seq_lens"])
        out = engine.propose(
            target_token_ids=call["target_token_ids"], target_positions=call["target_positions"],
            target_hidden_states=call["target_hidden_states"], next_token_ids=call["next_token_ids"],
            query_start_loc=call["query_start_loc"], seq_lens=call["seq_lens"],
            block_tables=[call["block_table"]], slot_mappings=[call["slot_mapping"]],
            token_indices_to_sample=call.get("token_indices_to_sample"),
            num_rejected_tokens=call.get("num_rejected_tokens"), return_logits=True)
        cols = _comparable_columns(call, k, mml)
        for r in range(out.draft_token_ids.shape[0]):
            c = int(cols[r])
            assert not check_drafts or torch.equal(out.draft_token_ids[r, :c], call["draft_token_ids"][r, :c]), (
                f"{name} call {meta['index']} (step {meta['step']}, synthetic={meta['synthetic']}) row {r}: "
                f"ours {out.draft_token_ids[r].tolist()} vLLM {call['draft_token_ids'][r].tolist()}")
            compared += c
            for j in range(c):
                theirs = call.get(f"logits{j}")
                if theirs is None:
                    continue
                theirs = theirs[r] if d2t is None else theirs[r][torch.arange(d2t.shape[0]) + d2t]
                worst_logit = max(worst_logit, float((out.draft_logits[r, j] - theirs).abs().max()))
    return int(compared), worst_logit


def _manifest_and_calls(name: str) -> tuple[dict, list[dict]]:
    run = _run_dir(name)
    manifest = json.loads((run / "manifest.json").read_text())
    return manifest, [load_file(str(run / c["file"])) for c in manifest["calls"]]


@pytest.mark.parametrize("name", RUNS)
def test_drafts_equal_vllm_call_for_call(name):
    compared, worst_logit = _replay(name)
    print(f"\n[vllm parity] {name}: {int(compared)} drafts identical, largest logit difference {worst_logit:.2e}")
    assert compared > 0
    if name in ROPE_RUNS:
        assert worst_logit < ROPE_LOGIT_TOLERANCE, f"{name}: logits differ from vLLM's by {worst_logit:.2e}"


def test_rope_runs_are_the_recorded_set():
    """The suite's rope heads and this file's list are one set (a run added on one side only fails)."""
    recorded = json.loads((Path(_run_dir(RUNS[0])).parents[1] / "ckpt" / "rope_heads.json").read_text())
    assert sorted(recorded) == sorted(ROPE_RUNS)


@pytest.mark.parametrize("name", ["rope-llama3-legacy", "rope-yarn-legacy"])
def test_a_wrong_rope_is_seen(name):
    """The rope recordings can fail: the same head with a plain rope of its theta (what the engine did
    before reading rope_scaling) gives logits far from vLLM's."""
    manifest, calls = _manifest_and_calls(name)
    engine = _engine(manifest, calls)
    for module in engine.head.modules():
        if isinstance(module, Attention):
            module.rope = Rope.plain(module.rope.theta, module.rope.head_dim)
    _, worst_logit = _replay(name, engine, check_drafts=False, max_calls=12)
    assert worst_logit > 100 * ROPE_LOGIT_TOLERANCE


def _rope_tables() -> tuple[dict, dict, dict]:
    if not ROOT:
        pytest.skip("no vLLM recordings: run scripts/test.sh (stage 2 records them) or set DRAFTER_VLLM_RECORDINGS")
    rope = Path(ROOT) / "rec" / "rope"
    if not (rope / "rope_tables.json").exists():
        pytest.fail(f"{rope}/rope_tables.json is missing: the vLLM recording stage did not produce it")
    return (json.loads(CASES.read_text()), json.loads((rope / "rope_tables.json").read_text()),
            load_file(str(rope / "rope_tables.safetensors")))


def _case_ids() -> list[str]:
    return [f"{c['name']}/{m}" for c in json.loads(CASES.read_text())["cases"] for m in ("eagle", "eagle3")]


@pytest.mark.parametrize("key", _case_ids())
def test_rope_tables_equal_vllm(key):
    """Each rope case of tests/fixtures/rope_cases.json in each layout: the engine reads the config
    into the rotation vLLM 0.32 builds (its cos / sin rows, every position), or refuses it naming the
    key; every config vLLM refuses, the engine refuses too."""
    cases, vllm, tables = _rope_tables()
    name, method = key.split("/")
    case = next(c for c in cases["cases"] if c["name"] == name)
    config = _case_config(cases, case, method)
    theirs = vllm[key]
    try:
        spec = parse_head(config, method, "config.json", case["max_model_len"])
    except HeadConfigError as e:
        assert case["refused"] in ("both", "drafter"), f"{key}: refused ({e}) but vLLM runs it: {theirs}"
        return
    assert "error" not in theirs, f"{key}: vLLM refuses it ({theirs['error']}), the engine accepted it"
    assert case["refused"] is None, f"{key}: expected a refusal"
    rope = spec.layer_shapes[0].rope
    rows = tables[key]
    cos, sin = rope.cos_sin(torch.arange(rows.shape[0]), torch.float32)
    assert 2 * cos.shape[1] == rows.shape[1] == theirs["rotary_dim"]
    ours = torch.cat((cos, sin), dim=-1)
    # the same float32 arithmetic in the same order as vLLM's table: bit for bit
    assert torch.equal(ours, rows), f"{key}: cos/sin differ from vLLM's by {float((ours - rows).abs().max()):.2e}"


def _case_config(cases: dict, case: dict, method: str) -> dict:
    """As record_vllm.rope_case_configs: EAGLE-1 plain Llama config, EAGLE-3 speculators."""
    layer = {**cases["base_layer_config"], **case["keys"]}
    return layer if method == "eagle" else {**cases["speculators_top"], "transformer_layer_config": layer}
