"""The service core without a network: epochs, unknown sessions, draining, idle expiry, and
detach wiping a session's blocks before anyone else gets them."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from drafter.service import core as core_mod
from drafter.wire import schema
from drafter.wire.errors import Code, DrafterError
from tests.support.core import run_with_core
from tests.support.engines import build_engine
from tests.support.requests import request
from tests.support.scenario import Scenario

MML, BLOCKS = 96, 24


@pytest.fixture(scope="module")
def engine(tiny_root):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_engine(tiny_root, "eagle3", k=3, max_model_len=MML, num_blocks=2 * BLOCKS)
    torch.set_num_threads(threads)


def _layout(core):
    d = core.desc
    return schema.AttachRequest(protocol_version=1, method="eagle3", num_speculative_tokens=3, hidden_dtype="float32",
                                hidden_size=d.hidden_size, num_aux_layers=d.num_aux_layers, max_model_len=MML,
                                max_num_seqs=4, max_num_batched_tokens=128,
                                kv_groups=[schema.KVGroup(block_size=16, num_blocks=BLOCKS)])


def _scenario(engine, start_pos=0):
    s = Scenario(block_sizes=(16,), num_blocks=(BLOCKS,), vocab_size=engine.spec.vocab_size,
                 hidden_width=engine.spec.hidden_input_width, k=3, max_model_len=MML, seed=3)
    s.add_request(0).next_pos = start_pos
    return s


def _blocks_after_detach(engine) -> tuple[float, float]:
    """Session A fills its blocks, detaches; returns A's blocks' largest |value| before and after."""
    async def body(core):
        a = await core.attach(_layout(core))
        s = core.sessions.get(a.session_id)
        mine = slice(s.bases[0], s.bases[0] + s.num_blocks[0])
        await core.serve_propose(request(_scenario(engine).call([(0, 40, 0)]).kwargs, a.session_id, core.epoch, 1))
        before = max(float(t[:, mine].abs().max()) for t in engine.kv.layers)
        await core.detach(schema.DetachRequest(session_id=a.session_id, epoch=core.epoch))
        after = max(float(t[:, mine].abs().max()) for t in engine.kv.layers)
        b = await core.attach(_layout(core))
        assert core.sessions.get(b.session_id).bases == s.bases, "the next session gets A's range"
        return before, after
    return run_with_core(engine, body)


def test_detach_wipes_the_blocks_before_reuse(engine, monkeypatch):
    before, after = _blocks_after_detach(engine)
    assert before > 0 and after == 0
    # and the check has teeth: without the wipe, the next session would find A's KV
    monkeypatch.setattr(core_mod, "zero_session_blocks", lambda engine, s: None)
    before, after = _blocks_after_detach(engine)
    assert after == before > 0


def test_epoch_session_and_draining(engine):
    async def body(core):
        a = await core.attach(_layout(core))
        kw = _scenario(engine).call([(0, 5, 0)]).kwargs
        with pytest.raises(DrafterError) as e:
            await core.serve_propose(request(kw, a.session_id, core.epoch + 1, 1))
        assert (e.value.code, e.value.field) == (Code.FAILED_PRECONDITION, "epoch")
        with pytest.raises(DrafterError) as e:
            await core.serve_propose(request(kw, "nope", core.epoch, 1))
        assert (e.value.code, e.value.field) == (Code.NOT_FOUND, "session_id")
        core.start_draining()
        with pytest.raises(DrafterError) as e:
            async with core.serving("grpc", "Info"):
                pass
        assert e.value.code == Code.UNAVAILABLE and "draining" in e.value.message
        assert await core.wait_idle(0)
        return True
    assert run_with_core(engine, body)


def test_idle_sessions_are_detached(engine):
    async def body(core):
        a = await core.attach(_layout(core))
        assert core.sessions.free_blocks() == [BLOCKS]
        while core.sessions.free_blocks() != [2 * BLOCKS]:  # the janitor sweeps every 50 ms here
            await asyncio.sleep(0.01)
        return a.session_id in core.sessions.sessions
    assert run_with_core(engine, body, session_idle_timeout_s=0.05) is False


def test_liveness_turns_on_a_stalled_engine_call(engine):
    async def body(core):
        assert not core.engine_stalled(60)
        core.runner.busy_since = time.monotonic() - 61  # as if one engine call had been running 61 s
        stalled = core.engine_stalled(60)
        core.runner.busy_since = None
        return stalled
    assert run_with_core(engine, body)
