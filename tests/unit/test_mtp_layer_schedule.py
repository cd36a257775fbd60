"""Which MTP layer each draft step runs (EngineConfig.mtp_layer_schedule), against vLLM 0.32's two runners.

vLLM 0.32's V1 runner (vLLM-CPU) drafts a DeepSeek MTP checkpoint with EagleProposer, which never
passes spec_step_idx: layer 0 at every step ("first_layer").  Model Runner V2 runs a multi-module
speculator this engine does not implement ("multi_module": refused).  docs/vllm-0.32-proposer.md,
section 14.  The references here are tests/support/dense_deepseek.py's dense model (written from the
equations, no code shared with drafter.models) with the step index pinned or passed through.
"""

from __future__ import annotations

import pytest
import torch

from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.engine.engine import DraftEngine
from drafter.engine.proposer import Proposer
from drafter.models.deepseek_loader import _share_vocab, load_deepseek_mtp
from drafter.models.tiny_deepseek import TinyDeepseekSizes, write_tiny_deepseek
from tests.support.dense_deepseek import DenseDeepseekReference
from tests.support.mtp_engine import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, EagerMTPEngine, plans
from tests.support.scenario import Scenario

SIZES = TinyDeepseekSizes(num_mtp_layers=2, fp8_block=None)


class _PinnedStep:
    """A head-like view of the dense model that runs one layer whatever step it is asked for."""

    def __init__(self, head, layer: int):
        self.head, self.layer = head, layer
        self.layers = [head.layers[layer]]

    def __call__(self, toks, positions, hid, caches, metas, backend, step: int = 0):
        return self.head(toks, positions, hid, caches, metas, backend, step=self.layer)

    def compute_logits(self, h, step: int = 0):
        return self.head.compute_logits(h, self.layer)

    def combine_hidden_states(self, hidden):
        return self.head.combine_hidden_states(hidden)

    def draft_to_target(self, ids):
        return ids


def _reference(out, k: int, schedule: str) -> DenseDeepseekReference:
    """first_layer: every step runs layer 0 and only layer 0's history exists (one unit);
    per_step: step s runs layer s mod n over layer s mod n's own history."""
    ref = DenseDeepseekReference(out / "head", out / "target", k, MAX_MODEL_LEN)
    if schedule == "first_layer":
        ref.head, ref.num_units = _PinnedStep(ref.head, 0), 1
    return ref


def _engine(out, k: int, schedule: str = "") -> DraftEngine:
    cfg = EngineConfig(method="deepseek_mtp", num_speculative_tokens=k, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                       max_num_batched_tokens=128, kv_groups=(KVGroupSpec(BLOCK_SIZE, NUM_BLOCKS),),
                       dtype="float32", attention_backend="reference", mtp_layer_schedule=schedule)
    return DraftEngine.from_dirs(out / "head", out / "target", config=cfg)


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp_two_layers")
    write_tiny_deepseek(out, seed=11, sizes=SIZES)
    return out


# ------------------------------------------------------------------ drafts against the references
@pytest.mark.parametrize("k", [2, 4], ids=["k<=n", "k>n"])
def test_deepseek_mtp_drafts_as_vllm_v1_runs_layer_zero_at_every_step(two_layers, k):
    engine = _engine(two_layers, k)  # the default schedule of deepseek_mtp
    assert engine.config.mtp_layer_schedule == "first_layer"
    first, per_step = _reference(two_layers, k, "first_layer"), _reference(two_layers, k, "per_step")
    scn = Scenario(block_sizes=(BLOCK_SIZE,), num_blocks=(NUM_BLOCKS,), vocab_size=SIZES.vocab_size,
                   hidden_width=SIZES.hidden_size, k=k, max_model_len=MAX_MODEL_LEN, seed=12)
    schedules_differ = False
    for plan in plans(k):
        call = scn.call(plan)
        ids = engine.propose(**call.kwargs).draft_token_ids
        want = first.propose(call)
        assert torch.equal(ids, want), f"plan {plan}"
        # the per-step reference sees the same calls: where its drafts differ, the test can tell them apart
        schedules_differ |= not torch.equal(per_step.propose(call)[:, 1:], want[:, 1:])
    assert schedules_differ, "layer 1 drafts like layer 0 on every call: the comparison proves nothing"


def test_first_layer_writes_only_layer_zero_kv(two_layers):
    engine = _engine(two_layers, 2)
    scn = Scenario(block_sizes=(BLOCK_SIZE,), num_blocks=(NUM_BLOCKS,), vocab_size=SIZES.vocab_size,
                   hidden_width=SIZES.hidden_size, k=2, max_model_len=MAX_MODEL_LEN, seed=13)
    for plan in ([(0, 9, 0), (1, 3, 0)], [(0, 3, 1), (1, 3, 0)]):
        engine.propose(**scn.call(plan).kwargs)
    kv = engine.kv_snapshot()
    assert kv[0].abs().sum() > 0 and kv[1].abs().sum() == 0


def test_the_proposers_per_step_schedule_runs_layer_s_at_step_s(two_layers):
    """The Proposer's per_step schedule (the engine's own mtp layout's rule; refused for deepseek_mtp
    by DraftEngine, so driven here directly) against the dense per-step reference."""
    head = load_deepseek_mtp(two_layers / "head", two_layers / "target", dtype=torch.float32)
    eager, first = EagerMTPEngine(head, 2), EagerMTPEngine(head, 2)
    first.proposer = Proposer(head, first.caches, None, 2, MAX_MODEL_LEN, None, "first_layer")
    ref = _reference(two_layers, 2, "per_step")
    scn = Scenario(block_sizes=(BLOCK_SIZE,), num_blocks=(NUM_BLOCKS,), vocab_size=SIZES.vocab_size,
                   hidden_width=SIZES.hidden_size, k=2, max_model_len=MAX_MODEL_LEN, seed=14)
    differ = False
    for plan in plans(2):
        call = scn.call(plan)
        ids, _ = eager.propose(call.kwargs, True)
        assert torch.equal(ids, ref.propose(call)), f"plan {plan}"
        differ |= not torch.equal(first.propose(call.kwargs, True)[0], ids)
    assert differ


# ------------------------------------------------------------------ refusals and defaults
def test_defaults_per_method():
    assert EngineConfig(method="deepseek_mtp").mtp_layer_schedule == "first_layer"
    assert EngineConfig(method="mtp").mtp_layer_schedule == "per_step"
    assert EngineConfig(method="mtp", mtp_layer_schedule="first_layer").mtp_layer_schedule == "first_layer"
    assert EngineConfig(method="eagle3").mtp_layer_schedule == ""


@pytest.mark.parametrize("method,schedule,words", [
    ("deepseek_mtp", "multi_module", "MultiModuleMTPSpeculator"),
    ("mtp", "multi_module", "not implemented"),
    ("deepseek_mtp", "per_layer", "must be one of"),
    ("eagle", "first_layer", "applies to methods"),
])
def test_config_refusals_name_the_key(method, schedule, words):
    with pytest.raises(ValueError, match="mtp_layer_schedule") as err:
        EngineConfig(method=method, mtp_layer_schedule=schedule)
    assert words in str(err.value)


def test_engine_refuses_what_vllm_never_drafts(two_layers):
    with pytest.raises(ValueError, match="mtp_layer_schedule='per_step'") as err:
        _engine(two_layers, 2, "per_step")
    assert "first_layer" in str(err.value)
    with pytest.raises(ValueError, match="num_speculative_tokens=3"):
        _engine(two_layers, 3)  # vLLM 0.32: k > n must be a multiple of n
    assert _engine(two_layers, 1, "per_step").config.mtp_layer_schedule == "per_step"  # one step: no difference


def test_without_a_top_level_embedding_every_layer_takes_the_first_layers():
    weights = {f"layers.{i}.embed_tokens.weight": torch.full((4, 2), float(i)) for i in range(3)}
    weights.update({f"layers.{i}.shared_head.head.weight": torch.full((4, 2), 10.0 + i) for i in range(3)})
    _share_vocab(weights, {}, 3)
    assert all(torch.equal(weights[f"layers.{i}.embed_tokens.weight"], torch.zeros(4, 2)) for i in range(3))
    assert torch.equal(weights["layers.2.shared_head.head.weight"], torch.full((4, 2), 12.0))
    target = {"embed": torch.ones(4, 2)}
    _share_vocab(weights, target, 3)
    assert torch.equal(weights["layers.1.embed_tokens.weight"], torch.ones(4, 2))


# ------------------------------------------------------------------ drafter serve
def test_serve_flag_and_variable_reach_the_engine_config(two_layers):
    import argparse

    from drafter.service.config import add_arguments, from_args
    from drafter.service.server import engine_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--method", "deepseek_mtp", "--model", str(two_layers / "head"), "--device", "cpu"]
    assert engine_config(from_args(parser.parse_args(base), {})).mtp_layer_schedule == "first_layer"
    flagged = from_args(parser.parse_args(base + ["--mtp-layer-schedule", "per_step"]), {})
    assert engine_config(flagged).mtp_layer_schedule == "per_step"
    from_env = from_args(parser.parse_args(base), {"DRAFTER_MTP_LAYER_SCHEDULE": "multi_module"})
    with pytest.raises(ValueError, match="mtp_layer_schedule='multi_module'"):
        engine_config(from_env)


# ------------------------------------------------------------------ attach: the target says which schedule it drafts with
def test_attach_refuses_another_schedule_naming_the_flag(two_layers):
    from drafter.service.core import describe_engine
    from drafter.service.sessions import layout_mismatches
    from drafter.wire import schema

    desc = describe_engine(_engine(two_layers, 2), 1 << 20)
    assert desc.mtp_layer_schedule == "first_layer"
    base = dict(protocol_version=1, method="deepseek_mtp", num_speculative_tokens=2, hidden_dtype="float32",
                hidden_size=SIZES.hidden_size, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=128,
                kv_groups=[schema.KVGroup(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)])
    assert layout_mismatches(schema.AttachRequest(**base), desc) == []  # not said: the drafter's own
    assert layout_mismatches(schema.AttachRequest(**base, mtp_layer_schedule="first_layer"), desc) == []
    (found,) = layout_mismatches(schema.AttachRequest(**base, mtp_layer_schedule="per_step"), desc)
    assert found.field == "mtp_layer_schedule" and "--mtp-layer-schedule per_step" in found.text()


def test_the_client_sends_the_session_s_schedule():
    from coordinator.clients import ServiceTransport
    from coordinator.routing import Endpoint
    from coordinator.session import SessionSpec

    sent = []

    class Client:
        def attach(self, req, timeout):
            sent.append(req)
            raise RuntimeError("stop after the request")

    transport = ServiceTransport(Endpoint("zmq", "127.0.0.1", 9), stream=False)
    transport.client.close()
    transport.client = Client()
    spec = SessionSpec(method="deepseek_mtp", num_speculative_tokens=2, hidden_size=64, num_aux_layers=0,
                       max_model_len=96, max_num_seqs=4, max_num_batched_tokens=128,
                       kv_groups=(KVGroupSpec(16, 64),), mtp_layer_schedule="first_layer")
    with pytest.raises(RuntimeError, match="stop"):
        transport.attach(spec, 1.0)
    assert sent[0].mtp_layer_schedule == "first_layer"


# ------------------------------------------------------------------ the engine's own mtp layout, first_layer
def test_mtp_first_layer_drafts_as_a_one_layer_head(tmp_path):
    """first_layer on the mtp layout = per_step on the same head cut to its layer 0 (whose only layer
    every step runs); per_step on both layers drafts otherwise."""
    from drafter.models.loader import load_head
    from drafter.models.tiny import write_tiny

    assert write_tiny("mtp-multi", tmp_path, seed=5) == "mtp"

    def engine(schedule: str, cut: bool = False) -> DraftEngine:
        head = load_head(tmp_path / "head", "mtp", tmp_path / "target", device="cpu", dtype=torch.float32,
                         max_model_len=MAX_MODEL_LEN)
        if cut:
            del head.layers[1:]
        cfg = EngineConfig(method="mtp", num_speculative_tokens=3, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                           max_num_batched_tokens=128, kv_groups=(KVGroupSpec(BLOCK_SIZE, NUM_BLOCKS),) * 2,
                           dtype="float32", attention_backend="reference", mtp_layer_schedule=schedule)
        return DraftEngine(head, head.spec, cfg)

    first, one_layer, per_step = engine("first_layer"), engine("per_step", cut=True), engine("per_step")
    scn = Scenario(block_sizes=(BLOCK_SIZE, BLOCK_SIZE), num_blocks=(NUM_BLOCKS, NUM_BLOCKS), vocab_size=512,
                   hidden_width=64, k=3, max_model_len=MAX_MODEL_LEN, seed=15)
    differ = False
    for plan in plans(3):
        call = scn.call(plan)
        ids = first.propose(**call.kwargs).draft_token_ids
        assert torch.equal(ids, one_layer.propose(**call.kwargs).draft_token_ids), f"plan {plan}"
        differ |= not torch.equal(ids, per_step.propose(**call.kwargs).draft_token_ids)
    assert differ
