"""The vLLM plugin's network source (drafter_vllm.sources.ServiceSource) against scripted clients.

Its policy, without processes or sockets: one deadline per step (attach included), fail closed,
backoff after failures, the same session over a rebuilt connection, re-attach after a restart.
The real transports against a real `drafter serve` run in tests/vllm_parity/test_plugin.py.
"""

from __future__ import annotations

import types

import pytest
import torch

from drafter.service.errors import Code, DrafterError
from drafter_vllm.settings import PluginSettings
from drafter_vllm.sources import ServiceSource, TargetFacts

FACTS = TargetFacts(method="eagle3", num_speculative_tokens=3, hidden_size=64, num_aux_layers=3, dtype="float32",
                    max_model_len=128, max_num_seqs=8, max_num_batched_tokens=512, block_size=32, num_blocks=128,
                    padded_drafter_batch=True, head_dir="h", target_dir="t", device="cpu", client="vllm/dp0")
DRAFTS = torch.tensor([[1, 2, 3]])


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class FakeClient:
    """Answers from a script: each entry is drafts, or an exception to raise."""

    def __init__(self, world):
        self.world = world
        self.session = types.SimpleNamespace(value=None, set=lambda resp: setattr(self.session, "value", resp))
        self.closed = False

    def attach(self, layout, timeout):
        self.world.timeouts.append(("attach", timeout))
        self.world.layouts.append(layout)
        if self.world.attach_error:
            raise self.world.attach_error
        self.world.epoch_n += 1
        resp = types.SimpleNamespace(session_id=f"s{self.world.epoch_n}", epoch=self.world.epoch)
        self.session.set(resp)
        return resp

    def propose(self, timeout, **kw):
        self.world.timeouts.append(("propose", timeout))
        self.world.proposed_on.append(self.session.value.session_id if self.session.value else None)
        step = self.world.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return types.SimpleNamespace(draft_token_ids=step)

    def detach(self, timeout):
        self.world.detached += 1

    def close(self):
        self.closed = True


@pytest.fixture
def world(monkeypatch):
    w = types.SimpleNamespace(script=[], timeouts=[], layouts=[], proposed_on=[], clients=[], attach_error=None,
                              epoch=7, epoch_n=0, detached=0)

    def connect(self):
        c = FakeClient(w)
        w.clients.append(c)
        return c

    monkeypatch.setattr(ServiceSource, "_connect", connect)
    return w


def source(clock, deadline_ms=50):
    settings = PluginSettings(endpoints=("h:5555",), transport="zmq", deadline_ms=deadline_ms)
    return ServiceSource(settings, FACTS, clock=clock)


def test_attach_layout_and_one_deadline_per_step(world):
    clock = Clock()
    src = source(clock)
    assert src.start()
    layout = world.layouts[0]
    assert layout["method"] == "eagle3" and layout["num_aux_layers"] == 3 and layout["hidden_size"] == 64
    assert layout["kv_groups"] == [{"block_size": 32, "num_blocks": 128}] and layout["client_name"] == "vllm/dp0"
    world.script = [DRAFTS]
    assert torch.equal(src.propose(), DRAFTS)
    assert all(0 < t <= 0.05 for _, t in world.timeouts)


def test_restarted_drafter_is_reattached_within_the_same_step(world):
    clock = Clock()
    src = source(clock)
    src.start()
    world.epoch = 8
    world.script = [DrafterError(Code.FAILED_PRECONDITION, "epoch", "stale"), DRAFTS]
    assert torch.equal(src.propose(), DRAFTS)
    assert src.attaches == 2 and src.epoch == 8
    assert world.proposed_on == ["s1", "s2"]


def test_failures_back_off_and_keep_the_session(world):
    clock = Clock()
    src = source(clock)
    src.start()
    world.script = [DrafterError(Code.DEADLINE_EXCEEDED, "", "slow")]
    assert src.propose() is None
    assert world.clients[0].closed  # a fresh connection next time
    calls = len(world.proposed_on)
    clock.t += 0.05
    assert src.propose() is None and len(world.proposed_on) == calls  # paused: the drafter is not asked
    clock.t += 0.1
    world.script = [DrafterError(Code.UNAVAILABLE, "", "down")]
    assert src.propose() is None and src.backoff == pytest.approx(0.2)  # doubled
    clock.t += 0.2
    world.script = [DRAFTS]
    assert torch.equal(src.propose(), DRAFTS)
    # the same session travelled over each new connection: no new attach, no leaked pool blocks
    assert src.attaches == 1 and world.proposed_on[-1] == "s1" and len(world.clients) == 3
    assert src.backoff == 0.0


def test_backoff_is_capped(world):
    clock = Clock()
    src = source(clock)
    world.attach_error = DrafterError(Code.UNAVAILABLE, "", "down")
    for _ in range(12):
        assert src.propose() is None
        clock.t += src.backoff
    assert src.backoff == ServiceSource.BACKOFF_S[1]


def test_refused_layout_fails_closed_and_is_logged_once(world, caplog):
    clock = Clock()
    src = source(clock)
    world.attach_error = DrafterError(Code.FAILED_PRECONDITION, "max_model_len", "128 != 2048")
    with caplog.at_level("WARNING", logger="vllm.drafter_vllm"):
        assert not src.start()
        for _ in range(3):
            clock.t += src.backoff
            assert src.propose() is None
    warnings = [r for r in caplog.records if "max_model_len" in r.getMessage()]
    assert len(warnings) == 1


def test_any_exception_fails_closed(world):
    clock = Clock()
    src = source(clock)
    src.start()
    world.script = [RuntimeError("bug in a transport")]
    assert src.propose() is None


def test_close_detaches(world):
    src = source(Clock())
    src.start()
    src.close()
    assert world.detached == 1 and src.session is None
