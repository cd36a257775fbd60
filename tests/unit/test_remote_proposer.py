"""RemoteProposer over the in-process transport: same drafts as the engine, and fail-closed
behaviour (deadline, refusal, dead drafter, open circuit, restart, fail-over) on a fake clock."""

from __future__ import annotations

import pytest
import torch

from coordinator.circuit import BreakerConfig, State
from coordinator.inprocess import InProcessTransport
from coordinator.remote_proposer import ProposerConfig, RemoteProposer
from coordinator.routing import Endpoint, Router, StaticEndpoints
from coordinator.session import DEADLINE_EXCEEDED, Code, DrafterError, SessionSpec
from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.engine.engine import DraftEngine
from tests.support.engines import tiny_dirs
from tests.support.scenario import Scenario

K, MAX_LEN, BLOCKS = 3, 96, 64
A, B = Endpoint("inprocess", "a", 0), Endpoint("inprocess", "b", 0)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Probe:
    """An in-process drafter whose calls can be counted, delayed (on the fake clock) or corrupted."""

    def __init__(self, inner: InProcessTransport, clock: Clock):
        self.inner, self.clock = inner, clock
        self.name = "inprocess"
        self.proposes = self.attaches = 0
        self.delay = 0.0
        self.junk = False
        self.timeouts = []

    def attach(self, spec, timeout):
        self.attaches += 1
        return self.inner.attach(spec, timeout)

    def request_drafts(self, session, request, timeout):
        self.proposes += 1
        self.timeouts.append(timeout)
        if self.delay > timeout:  # what a real transport does when the answer is late
            self.clock.t += timeout
            raise DrafterError(Code.DEADLINE_EXCEEDED, "", "no reply in time")
        out = self.inner.request_drafts(session, request, timeout)
        return torch.zeros(1, 1, dtype=torch.long) if self.junk else out

    def detach(self, session, timeout):
        self.inner.detach(session, timeout)

    def close(self):
        pass


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory.mktemp("rp"), "eagle")[1]


def _spec():
    return SessionSpec(method="eagle", num_speculative_tokens=K, hidden_size=64, num_aux_layers=0,
                       max_model_len=MAX_LEN, max_num_seqs=8, max_num_batched_tokens=256,
                       kv_groups=(KVGroupSpec(16, BLOCKS),), client="test")


def _calls(n, seed=0):
    scn = Scenario(block_sizes=(16,), num_blocks=(BLOCKS,), vocab_size=512, hidden_width=64, k=K,
                   max_model_len=MAX_LEN, seed=seed)
    plans = [[(0, 9, 0), (1, 5, 0)]] + [[(0, K + 1, i % (K + 1)), (1, K + 1, 0)] for i in range(n - 1)]
    return [scn.call(p).kwargs for p in plans]


def _proposer(dirs, clock, endpoints=(A,), failover=True, threshold=2, deadline=0.5, max_events=4096):
    probes = {ep: Probe(InProcessTransport(dirs / "head", dirs / "target", "eagle"), clock) for ep in endpoints}
    cfg = ProposerConfig(deadline_s=deadline, failover=failover, max_events=max_events,
                         breaker=BreakerConfig(failure_threshold=threshold, backoff_base_s=1.0, backoff_max_s=4.0,
                                               jitter=0.0))
    p = RemoteProposer(_spec(), router=Router(StaticEndpoints(list(endpoints))), key="target/dp0",
                       connect=lambda ep: probes[ep], config=cfg, clock=clock)
    return p, probes


def test_same_drafts_as_the_in_process_engine(dirs):
    clock = Clock()
    p, _ = _proposer(dirs, clock)
    assert p.start() and p.generation == 1
    engine = DraftEngine.from_dirs(dirs / "head", dirs / "target", EngineConfig(
        method="eagle", num_speculative_tokens=K, max_model_len=MAX_LEN, max_num_seqs=8, max_num_batched_tokens=256,
        kv_groups=(KVGroupSpec(16, BLOCKS),)))
    for kw in _calls(5):
        got = p.propose(**kw, accepted_counts=torch.full((2,), -1))
        assert torch.equal(got, engine.propose(**kw).draft_token_ids)
    assert p.stats.drafted == 5 and not p.stats.no_drafts


def test_dead_drafter_fails_closed_then_the_circuit_stops_calling_it(dirs):
    clock = Clock()
    p, probes = _proposer(dirs, clock, threshold=2)
    p.start()
    calls = _calls(8)
    assert p.propose(**calls[0]) is not None
    probes[A].inner.fail(Code.UNAVAILABLE)
    assert p.propose(**calls[1]) is None and p.propose(**calls[2]) is None
    assert p.breakers[A].state == State.OPEN
    before = probes[A].proposes
    assert p.propose(**calls[3]) is None and probes[A].proposes == before  # open: no call at all
    assert p.stats.no_drafts == {"UNAVAILABLE": 2, "circuit_open": 1}
    clock.t += 1.0  # backoff over: one trial, still dead -> open again with the backoff doubled
    assert p.propose(**calls[4]) is None and probes[A].proposes == before + 1
    assert p.breakers[A].state == State.OPEN and p.breakers[A].last_backoff == 2.0


def test_a_long_outage_keeps_the_latest_events_and_counts_every_step(dirs):
    """One no-draft event per step of an outage: the proposer keeps the most recent
    ProposerConfig.max_events of them (a target runs for days), and counts them all."""
    clock = Clock()
    p, probes = _proposer(dirs, clock, threshold=1, max_events=8)
    p.start()
    calls = _calls(2)
    probes[A].inner.fail(Code.UNAVAILABLE)
    for _ in range(50):
        assert p.propose(**calls[1]) is None
    assert len(p.events) == 8 and all(e.kind == "no_drafts" for e in p.events)
    assert sum(p.stats.no_drafts.values()) == 50
    assert [e.t for e in p.events] == sorted(e.t for e in p.events)  # the latest, in order


def test_restart_changes_the_epoch_and_the_client_reattaches_by_itself(dirs):
    clock = Clock()
    p, probes = _proposer(dirs, clock)
    p.start()
    calls = _calls(4)
    assert p.propose(**calls[0]) is not None
    probes[A].inner.restart()  # new epoch, sessions gone
    assert p.propose(**calls[1]) is None  # FAILED_PRECONDITION -> re-attached, no drafts this step
    assert p.generation == 2 and probes[A].attaches == 2
    assert [e.kind for e in p.events if e.kind in ("session_lost", "attached")] == ["attached", "session_lost",
                                                                                   "attached"]
    # the target resends context after a generation change; any valid call now drafts again
    assert p.propose(**_calls(1, seed=3)[0]) is not None


def test_a_forgotten_session_is_reattached(dirs):
    clock = Clock()
    p, probes = _proposer(dirs, clock)
    p.start()
    probes[A].inner.sessions.clear()  # NOT_FOUND
    assert p.propose(**_calls(1)[0]) is None and p.generation == 2
    assert p.stats.no_drafts == {"session_lost": 1}
    assert p.breakers[A].state == State.CLOSED


def test_deadline_bounds_attach_and_propose_together(dirs):
    clock = Clock()
    p, probes = _proposer(dirs, clock, deadline=0.5)
    p.start()
    probes[A].delay = 3.0  # the drafter answers after 3 s
    t0 = clock.t
    assert p.propose(**_calls(1)[0]) is None
    assert clock.t - t0 <= 0.5 and max(probes[A].timeouts) <= 0.5
    assert p.stats.no_drafts == {DEADLINE_EXCEEDED: 1} and p.stats.max_wait_s <= 0.5
    # a lost session whose re-attach would not fit in what is left of the budget waits a step
    probes[A].delay = 0.0
    probes[A].inner.sessions.clear()
    orig = probes[A].request_drafts

    def slow_not_found(session, request, timeout):
        clock.t += 0.6
        raise DrafterError(Code.NOT_FOUND, "session_id", "unknown")

    probes[A].request_drafts = slow_not_found
    attaches = probes[A].attaches
    assert p.propose(**_calls(1)[0]) is None and probes[A].attaches == attaches  # no time left: no attach
    probes[A].request_drafts = orig
    assert p.propose(**_calls(1)[0]) is None and probes[A].attaches == attaches + 1  # next step attaches


def test_refused_input_fails_closed_without_tripping_the_breaker(dirs):
    clock = Clock()
    p, _ = _proposer(dirs, clock, threshold=1)
    p.start()
    bad = dict(_calls(1)[0])
    bad["seq_lens"] = bad["seq_lens"] + 1000  # beyond max_model_len
    assert p.propose(**bad) is None
    assert p.stats.no_drafts == {"invalid_argument": 1} and p.breakers[A].state == State.CLOSED


def test_malformed_answer_is_no_drafts(dirs):
    clock = Clock()
    p, probes = _proposer(dirs, clock)
    p.start()
    probes[A].junk = True
    assert p.propose(**_calls(1)[0]) is None and p.stats.no_drafts == {"malformed": 1}


def test_fail_over_to_the_next_endpoint_and_back(dirs):
    clock = Clock()
    p, probes = _proposer(dirs, clock, endpoints=(A, B), threshold=1)
    preferred, other = Router(StaticEndpoints([A, B])).rank("target/dp0")
    p.start()
    assert p.endpoint == preferred
    probes[preferred].inner.fail(Code.UNAVAILABLE)
    calls = _calls(6)
    assert p.propose(**calls[0]) is None  # fails, breaker opens
    assert p.propose(**calls[1]) is None and p.endpoint == other  # moved: attach there, no drafts yet
    assert p.propose(**calls[0]) is not None  # drafts from the other drafter (context resent from 0)
    probes[preferred].inner.restart()  # the preferred drafter is back
    clock.t += 1.0  # its backoff elapsed: the key goes home (stable mapping)
    assert p.propose(**calls[1]) is None and p.endpoint == preferred and p.generation == 3
    kinds = [e.kind for e in p.events if e.kind in ("moved", "attached")]
    assert kinds == ["attached", "moved", "attached", "moved", "attached"]


def test_without_failover_the_session_waits_for_its_own_drafter(dirs):
    clock = Clock()
    p, probes = _proposer(dirs, clock, endpoints=(A, B), failover=False, threshold=1)
    p.start()
    home = p.endpoint
    probes[home].inner.fail()
    for kw in _calls(3):
        assert p.propose(**kw) is None
    assert p.endpoint == home and p.generation == 1


def test_a_refused_session_layout_fails_closed_and_backs_off(dirs):
    clock = Clock()
    probe = Probe(InProcessTransport(dirs / "head", dirs / "target", "eagle"), clock)
    spec = SessionSpec(method="eagle3", num_speculative_tokens=K, hidden_size=64, num_aux_layers=3,
                       max_model_len=MAX_LEN, max_num_seqs=8, max_num_batched_tokens=256,
                       kv_groups=(KVGroupSpec(16, BLOCKS),))
    p = RemoteProposer(spec, router=Router(StaticEndpoints([A])), key="k", connect=lambda ep: probe,
                       config=ProposerConfig(breaker=BreakerConfig(failure_threshold=2, jitter=0.0)), clock=clock)
    assert not p.start() and p.generation == 0
    assert p.propose(**_calls(1)[0]) is None
    assert p.stats.no_drafts == {"attach INVALID_ARGUMENT": 2}
    assert p.breakers[A].state == State.OPEN and p.propose(**_calls(1)[0]) is None
