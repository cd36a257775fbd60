"""The reference target engine in one process, drafting through RemoteProposer + the in-process
transport with the trained tiny pair: lossless, drafts equal to a fresh engine replaying the same
calls, catch-up after a drafter outage or restart, and the sampling distribution."""

from __future__ import annotations

import pytest
import torch

from coordinator.circuit import BreakerConfig
from coordinator.inprocess import InProcessTransport
from coordinator.remote_proposer import ProposerConfig, RemoteProposer
from coordinator.routing import Router, StaticEndpoints
from coordinator.session import Code
from coordinator.target.engine import TargetConfig, TargetEngine
from coordinator.target.request import random_requests
from coordinator.target.verify import ks_uniform
from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.engine.engine import DraftEngine
from tests.support.pair import one_torch_thread, trained_pair  # noqa: F401 (fixture)

K = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root, report = trained_pair(tmp_path_factory)
    print(f"\n[distill] {report.to_json()}")
    return root


def _cfg(pair, k=K, **kw):
    return TargetConfig(str(pair / "target"), method="eagle3", aux_layer_ids=(1, 2, 3), num_speculative_tokens=k,
                        max_model_len=128, max_num_seqs=4, num_blocks=64, **kw)


class Scripted(InProcessTransport):
    """An in-process drafter that dies and restarts on cue (call numbers)."""

    def __init__(self, *a, script=None, **kw):
        super().__init__(*a, **kw)
        self.script = script or {}
        self.n = 0

    def request_drafts(self, session, request, timeout):
        action = self.script.get(self.n)
        self.n += 1
        if action == "die":
            self.fail(Code.UNAVAILABLE)
        elif action == "restart":
            self.restart()
        return super().request_drafts(session, request, timeout)


class TickClock:
    """Advances 10 ms per reading: the breaker's backoff then elapses after a deterministic number
    of steps, whatever the machine's speed."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 0.01
        return self.t


def _run(pair, requests, k=K, transport=None, **cfg):
    engine = TargetEngine(_cfg(pair, k, record_calls=True, **cfg))
    if k:
        transport = transport or InProcessTransport(pair / "head", pair / "target", "eagle3")
        proposer = RemoteProposer(engine.session_spec("test"), router=Router(StaticEndpoints(["inprocess://x:0"])),
                                  key="test/dp0", connect=lambda ep: transport, clock=TickClock(),
                                  config=ProposerConfig(deadline_s=30, breaker=BreakerConfig(
                                      failure_threshold=3, backoff_base_s=0.3, backoff_max_s=0.3)))
        proposer.start()
        engine.proposer = proposer
    for r in requests:
        engine.add(r)
    return engine, engine.run()


def _replay(pair, engine):
    """Feed every recorded call, per session generation, to a fresh engine: drafts must be equal."""
    fresh, generation, checked = None, None, 0
    for call in engine.calls:
        if call.drafts is None:
            continue
        if call.generation != generation:
            generation = call.generation
            fresh = DraftEngine.from_dirs(pair / "head", pair / "target", EngineConfig(
                method="eagle3", num_speculative_tokens=K, max_model_len=128, max_num_seqs=4,
                max_num_batched_tokens=1024, kv_groups=(KVGroupSpec(16, 64),)))
        out = fresh.propose(**call.kwargs, batch_padded=call.padding.batch_padded,
                            tokens_padded=call.padding.tokens_padded)
        assert torch.equal(out.draft_token_ids, call.drafts), f"step {call.step}"
        checked += 1
    return checked


def test_greedy_speculation_is_lossless_and_accepts(pair):
    reqs = random_requests(6, vocab_size=512, max_new_tokens=40, seed=1)
    _, base = _run(pair, reqs, k=0)
    engine, out = _run(pair, reqs)
    assert out == base
    s = engine.stats
    print(f"\n[target engine] acceptance length {s.acceptance_length:.2f}, per position "
          f"{[round(a, 2) for a in s.acceptance_by_position]}, steps {len(engine.steps)} vs {len(reqs) and 40}")
    assert s.acceptance_length > 1.5  # the trained head really drafts
    assert _replay(pair, engine) == sum(1 for c in engine.calls if c.drafts is not None) > 10
    # continuous batching: 6 requests through 4 slots, prefills mixed with decode rows in one call
    assert any(len(set((c.kwargs["query_start_loc"][1:] - c.kwargs["query_start_loc"][:-1]).tolist())) > 1
               for c in engine.calls[1:])


def test_outage_and_restart_catch_up_and_stay_lossless(pair):
    reqs = random_requests(3, vocab_size=512, max_new_tokens=48, seed=2)
    _, base = _run(pair, reqs, k=0)
    # drafter calls 4..6 find it dead (the circuit opens), the trial call 7 finds it restarted
    transport = Scripted(pair / "head", pair / "target", "eagle3", script={4: "die", 7: "restart"})
    engine, out = _run(pair, reqs, transport=transport)
    assert out == base
    oks = [c.drafts is not None for c in engine.calls]
    back = oks.index(True, 4)
    assert oks[:4] == [True] * 4 and back >= 8 and all(oks[back:]), oks  # dead, re-attached, resumed
    reasons = engine.proposer.stats.no_drafts
    assert reasons["UNAVAILABLE"] == 3 and reasons["session_lost"] == 1 and reasons["circuit_open"] >= 1
    resumed = engine.calls[back]  # the first call after the re-attach resends every context from 0
    assert resumed.generation == 2 and int(resumed.kwargs["target_positions"][0]) == 0
    assert _replay(pair, engine) > 5


def test_token_budget_defers_requests_without_losing_anything(pair):
    reqs = random_requests(4, vocab_size=512, max_new_tokens=24, seed=3)
    _, base = _run(pair, reqs, k=0)
    engine, out = _run(pair, reqs, max_num_batched_tokens=20)  # less than the prefills together
    assert out == base
    assert all(c.kwargs["target_token_ids"].shape[0] <= 20 for c in engine.calls)
    assert _replay(pair, engine) > 0


def test_sampling_follows_the_target_distribution(pair):
    """Every sampled token's randomised PIT under the target's own distribution is U(0, 1)."""
    reqs = random_requests(6, vocab_size=512, max_new_tokens=40, seed=4, temperature=1.0)
    engine, out = _run(pair, reqs)
    _, base = _run(pair, reqs, k=0)
    assert len(engine.stats.pit) == sum(len(v) for v in out.values())
    d, pvalue = ks_uniform(engine.stats.pit)
    print(f"\n[sampling] {len(engine.stats.pit)} tokens, KS D={d:.3f} p={pvalue:.3f}, "
          f"acceptance length {engine.stats.acceptance_length:.2f}")
    assert pvalue > 1e-3
    again, out2 = _run(pair, reqs)
    assert out2 == out  # seeded per request: reproducible


def test_calls_carry_vllm_padded_batch_semantics(pair):
    """Each call is what vLLM's proposer receives in the padded path: the query's tokens (the
    drafter shifts them), seq_lens that count rejected rows, the last accepted row to sample,
    rejected counts, and (for the drafter's metrics) accepted counts."""
    reqs = random_requests(3, vocab_size=512, max_new_tokens=20, seed=5)
    engine, _ = _run(pair, reqs)
    saw_rejection = False
    for call in engine.calls:
        kw = call.kwargs
        qsl, rej = kw["query_start_loc"].tolist(), kw["num_rejected_tokens"].tolist()
        accepted = call.accepted_counts.tolist()
        for i in range(len(rej)):
            lo, hi = qsl[i], qsl[i + 1]
            assert kw["token_indices_to_sample"][i] == hi - 1 - rej[i]
            assert kw["seq_lens"][i] == kw["target_positions"][hi - 1] + 1  # rejected rows included
            if hi - lo == K + 1 and call.step > 0:  # a decode step that verified k drafts
                saw_rejection |= rej[i] > 0
                assert accepted[i] == K - rej[i]
            if call.step == 0:  # prefills: nothing verified, nothing to report
                assert rej[i] == 0 and accepted[i] == -1
    assert saw_rejection
