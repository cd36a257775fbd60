"""Pre-drafts pushed over ZMQ (issue 23 step 4): a real `drafter serve --predraft-outcomes 4` with
the trained pair, the reference target drafting through RemoteProposer wrapped by
PushedPreDrafting.  Greedy output equals plain decoding; pushes arrive and are used (steps whose
rows all hit go out without waiting for the reply); the drafter's metrics count hits by a."""

from __future__ import annotations

import urllib.request
from dataclasses import fields, replace

import pytest

from coordinator.clients import ServiceTransport
from coordinator.predraft import PushedPreDrafting
from coordinator.remote_proposer import ProposerConfig, RemoteProposer
from coordinator.routing import Router, StaticEndpoints
from coordinator.target.predraft_report import LoopConfig, run_loop
from coordinator.target.engine import TargetConfig, TargetEngine
from coordinator.target.request import random_requests
from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.engine.engine import DraftEngine
from tests.support.pair import one_torch_thread, trained_pair  # noqa: F401 (fixture)
from tests.support.predraft import replay_against_offline
from tests.support.servers import DrafterServer

K = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return trained_pair(tmp_path_factory)[0]


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    log = tmp_path_factory.mktemp("predraft-logs") / "drafter.log"
    with DrafterServer(pair, "eagle3", log_path=log, device="cpu", num_speculative_tokens=K, max_model_len=128,
                       max_num_seqs=8, max_num_batched_tokens=1024, kv_blocks=256, block_sizes=16,
                       torch_threads=1, predraft_outcomes=4).start() as s:
        yield s


def _unbound(cfg: ProposerConfig) -> ProposerConfig:
    """Pushes ride the unbound Propose: bound sessions off where this proposer has them."""
    if "bound" in {f.name for f in fields(cfg)}:
        return replace(cfg, bound=replace(cfg.bound, mode="off"))
    return cfg


@pytest.fixture(scope="module")
def requests_and_base(pair):
    reqs = random_requests(4, vocab_size=512, max_new_tokens=40, seed=1)
    return reqs, run_loop(LoopConfig(str(pair), k=0), reqs)[1]


def _run(pair, server, reqs, **kw):
    engine = TargetEngine(TargetConfig(str(pair / "target"), method="eagle3", aux_layer_ids=(1, 2, 3),
                                       num_speculative_tokens=K, max_model_len=128, max_num_seqs=4, num_blocks=64,
                                       record_calls=True))
    endpoint = server.zmq_endpoint.replace("tcp://", "zmq://")
    proposer = RemoteProposer(engine.session_spec("predraft-test"), router=Router(StaticEndpoints([endpoint])),
                              key="predraft/dp0", connect=lambda ep: ServiceTransport(ep, timeout_s=30),
                              config=_unbound(ProposerConfig(deadline_s=30)))
    pushed = kw.pop("cls", PushedPreDrafting)(proposer, **kw)
    assert pushed.start()
    engine.proposer = pushed
    for r in reqs:
        engine.add(r)
    out = engine.run()
    pushed.close()
    return engine, pushed, out


def test_pushed_predrafts_are_used_and_output_stays_lossless(pair, server, requests_and_base):
    """A target whose verification outlasts pre-drafting (modelled: each call waits up to 10 s for
    the previous call's push, an event, not a sleep) finds every push in time."""
    reqs, base = requests_and_base
    engine, pushed, out = _run(pair, server, reqs, push_wait_s=10.0)
    stats = pushed.picker.stats
    print(f"\n[predraft zmq] steps {pushed.steps}, hit rate {stats.hit_rate:.2f} by a {stats.hit_rate_by_a()}, "
          f"sets pushed {stats.offered} (late {stats.late}), steps sent without waiting {pushed.unawaited}, "
          f"acceptance length {engine.stats.acceptance_length:.2f}")
    assert out == base
    assert stats.offered > 10 and stats.hit_rate > 0.3 and pushed.unawaited > 0
    # what the target verified on every hit is what a fresh engine pre-drafts offline for that outcome
    fresh = DraftEngine.from_dirs(pair / "head", pair / "target", EngineConfig(
        method="eagle3", num_speculative_tokens=K, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=1024,
        kv_groups=(KVGroupSpec(16, 64),), predraft_outcomes=4))
    hits, _ = replay_against_offline(engine.calls, fresh)
    assert hits == sum(stats.hits.values()) > 0
    metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    assert 'drafter_predraft_hits_total{a="3"}' in metrics and "drafter_predrafts_total" in metrics
    assert 'drafter_predraft_accepted_tokens_total{position="1",source="predraft"}' in metrics
    assert 'drafter_predraft_accepted_tokens_total{position="1",source="exact"}' in metrics


class ReadsLate(PushedPreDrafting):
    """Reads the socket only inside its round trips, i.e. always after it has picked: every push
    reaches it after the verification it was for (what a target quicker than the drafter sees)."""

    def _read_pushes(self, client) -> None:
        pass


def _counter(server, name: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_pushes_arriving_after_the_pick_are_dropped(pair, server, requests_and_base):
    """...and the drafter, seeing the target verify its exact drafts where it had counted a hit,
    halves its budget down to none (a probe every few calls): it stops pre-drafting for nothing."""
    reqs, base = requests_and_base
    pushes0, late0 = _counter(server, "drafter_predraft_pushes_total"), _counter(server, "drafter_predraft_late_total")
    engine, pushed, out = _run(pair, server, reqs, cls=ReadsLate)
    stats = pushed.picker.stats
    pushes = _counter(server, "drafter_predraft_pushes_total") - pushes0
    late = _counter(server, "drafter_predraft_late_total") - late0
    print(f"\n[predraft zmq, late pushes] late {stats.late}, used {sum(stats.hits.values())} of {pushed.steps} steps; "
          f"the drafter pushed {pushes:.0f} sets and saw {late:.0f} late")
    assert out == base
    # every push but the last call's (read at detach, with no pick after it) came after its pick
    assert stats.late >= pushes - 1 and stats.offered <= 1
    assert not stats.hits and pushed.unawaited == 0  # and none was ever used
    assert late >= 1 and pushes < pushed.steps - 2  # the budget went down: fewer sets than calls
