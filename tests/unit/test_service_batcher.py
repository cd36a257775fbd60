"""Fused batching: one engine call for several sessions, each getting exactly its solo drafts."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest
import torch

from drafter.wire import schema
from drafter.service.batching.queue import Batcher, Pending
from drafter.service.batching.runner import EngineRunner
from drafter.service.core import describe_engine
from drafter.wire.errors import Code, DrafterError
from drafter.service.sessions import SessionTable
from tests.support.engines import BLOCK_SIZES, build_engine
from tests.support.requests import request
from tests.support.scenario import Scenario

MML = 96
SESSION_BLOCKS = 64
HEAD = "eagle-2groups"  # two KV groups with different block sizes: the harder case for fusing


@pytest.fixture(scope="module")
def setup(tiny_root):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: OpenMP threads only spin against each other on 2 cores
    pool = build_engine(tiny_root, HEAD, k=3, max_model_len=MML, num_blocks=4 * SESSION_BLOCKS, max_num_seqs=8)
    yield tiny_root, pool
    torch.set_num_threads(threads)


def _solo(tiny_root):
    return build_engine(tiny_root, HEAD, k=3, max_model_len=MML, num_blocks=SESSION_BLOCKS, max_num_seqs=8)


def _scenario(engine, seed):
    return Scenario(block_sizes=BLOCK_SIZES, num_blocks=(SESSION_BLOCKS,) * 2, vocab_size=engine.spec.vocab_size,
                    hidden_width=engine.spec.hidden_input_width, k=3, max_model_len=MML, seed=seed)


def _layout(engine, max_num_seqs=4):
    d = describe_engine(engine, 1 << 26)
    return schema.AttachRequest(
        protocol_version=1, method=d.method, num_speculative_tokens=3, hidden_dtype="float32",
        hidden_size=d.hidden_size, num_aux_layers=d.num_aux_layers, max_model_len=MML, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=128, kv_groups=[schema.KVGroup(block_size=bs, num_blocks=SESSION_BLOCKS)
                                               for bs in BLOCK_SIZES])


def _pending(session, kwargs, rid=0, **call):
    return Pending(session, request(kwargs, session.id, 0, rid, **call), concurrent.futures.Future())


PLANS = [
    [(0, 5, 0), (1, 17, 0)],
    [(0, 4, 1), (1, 4, 0)],
    [(1, 4, 3), (0, 4, 2)],
    [(0, 4, 0), (1, 4, 1)],
]


def test_fused_calls_give_every_session_its_solo_drafts(setup):
    tiny_root, pool = setup
    table = SessionTable(describe_engine(pool, 1 << 26), max_sessions=4)
    sessions = [table.attach(_layout(pool)) for _ in range(3)]
    solos = [_solo(tiny_root) for _ in sessions]
    remote_scn = [_scenario(pool, seed) for seed in (1, 2, 3)]
    solo_scn = [_scenario(pool, seed) for seed in (1, 2, 3)]
    calls = []
    runner = EngineRunner(pool, calls.append)
    for step, plan in enumerate(PLANS):
        # session 2 only joins from the second step on, and uses temperatures 0 (greedy) explicitly
        active = [0, 1] if step == 0 else [0, 1, 2]
        items, expected = [], []
        for i in active:
            temps = [0.0] * len(plan) if i == 2 else None
            kw = remote_scn[i].call(plan, temperatures=temps).kwargs
            items.append(_pending(sessions[i], kw, rid=step))
            expected.append(solos[i].propose(**solo_scn[i].call(plan, temperatures=temps).kwargs).draft_token_ids)
        results = runner.run_batch(items)
        for r, e in zip(results, expected):
            assert not isinstance(r, Exception), r
            assert torch.equal(r.draft_token_ids, e), f"step {step}"
    assert [c.sessions for c in calls] == [2, 3, 3, 3], "each step must be ONE engine call over all sessions"
    assert calls[-1].batch == 6


def test_a_bad_request_is_refused_alone(setup):
    tiny_root, pool = setup
    table = SessionTable(describe_engine(pool, 1 << 26), max_sessions=4)
    good_a, bad, good_b = (table.attach(_layout(pool)) for _ in range(3))
    sa, sb, sbad = _scenario(pool, 1), _scenario(pool, 2), _scenario(pool, 3)
    ra, rb = _scenario(pool, 1), _scenario(pool, 2)
    solo_a, solo_b = _solo(tiny_root), _solo(tiny_root)
    broken = sbad.call(PLANS[0]).kwargs
    broken["slot_mappings"] = [broken["slot_mappings"][0].clone(), broken["slot_mappings"][1]]
    broken["slot_mappings"][0][3] += 1  # consistent ranges, but not what block_tables[0] says
    calls = []
    results = EngineRunner(pool, calls.append).run_batch([
        _pending(good_a, sa.call(PLANS[0]).kwargs), _pending(bad, broken), _pending(good_b, sb.call(PLANS[0]).kwargs)])
    assert isinstance(results[1], DrafterError)
    assert (results[1].code, results[1].field) == (Code.INVALID_ARGUMENT, "slot_mappings[0]")
    assert torch.equal(results[0].draft_token_ids, solo_a.propose(**ra.call(PLANS[0]).kwargs).draft_token_ids)
    assert torch.equal(results[2].draft_token_ids, solo_b.propose(**rb.call(PLANS[0]).kwargs).draft_token_ids)
    assert len(calls) == 1 and calls[0].sessions == 2


def test_a_lone_bad_request_is_refused_by_the_engine(setup):
    """Alone in its engine call a request skips the batcher's own check (batching.checks.engine_validate):
    engine.propose must still validate it (the service never takes the trusted validate=False
    path), so a slot mapping that disagrees with its block table is refused, not written."""
    _, pool = setup
    table = SessionTable(describe_engine(pool, 1 << 26), max_sessions=4)
    bad = table.attach(_layout(pool))
    broken = _scenario(pool, 3).call(PLANS[0]).kwargs
    broken["slot_mappings"] = [broken["slot_mappings"][0].clone(), broken["slot_mappings"][1]]
    broken["slot_mappings"][0][3] += 1
    before = pool.kv_snapshot()
    calls = []
    results = EngineRunner(pool, calls.append).run_batch([_pending(bad, broken)])
    assert isinstance(results[0], DrafterError)
    assert (results[0].code, results[0].field) == (Code.INVALID_ARGUMENT, "slot_mappings[0]")
    assert not calls
    assert all(torch.equal(a, b) for a, b in zip(before, pool.kv_snapshot()))


def test_detached_expired_and_dp_padded_requests(setup):
    tiny_root, pool = setup
    table = SessionTable(describe_engine(pool, 1 << 26), max_sessions=4)
    a, b, c = (table.attach(_layout(pool)) for _ in range(3))
    table.detach(b.id)
    kws = [_scenario(pool, s).call(PLANS[0]).kwargs for s in (1, 2, 3)]
    calls = []
    items = [_pending(a, kws[0], deadline=0.0), _pending(b, kws[1]), _pending(c, kws[2], batch_padded=8)]
    results = EngineRunner(pool, calls.append).run_batch(items)
    assert results[0].code == Code.DEADLINE_EXCEEDED
    assert (results[1].code, results[1].field) == (Code.NOT_FOUND, "session_id")
    assert results[2].batch_padded == 8, "agreed padded sizes are honoured"
    assert len(calls) == 1


def test_packing_respects_the_engine_batch_limit(setup):
    tiny_root, pool = setup  # max_num_seqs 8
    table = SessionTable(describe_engine(pool, 1 << 26), max_sessions=4)
    sessions = [table.attach(_layout(pool, max_num_seqs=4)) for _ in range(3)]
    plan = [(r, 3, 0) for r in range(4)]
    calls = []
    results = EngineRunner(pool, calls.append).run_batch(
        [_pending(s, _scenario(pool, i).call(plan).kwargs) for i, s in enumerate(sessions)])
    assert all(not isinstance(r, Exception) for r in results)
    assert [c.batch for c in calls] == [8, 4]


def test_batcher_collects_concurrent_requests_into_one_call(setup):
    tiny_root, pool = setup  # max_num_seqs 8: four requests of two rows fill one engine call
    table = SessionTable(describe_engine(pool, 1 << 26), max_sessions=4)
    sessions = [table.attach(_layout(pool)) for _ in range(4)]
    kws = [_scenario(pool, i).call(PLANS[0]).kwargs for i in range(4)]
    calls = []

    async def main():
        executor = concurrent.futures.ThreadPoolExecutor(1)
        # a window far longer than this test: the batch goes when it is full, not when the window ends
        batcher = Batcher(EngineRunner(pool, calls.append), executor, window_s=600.0)
        batcher.start()
        outs = await asyncio.gather(*(batcher.submit(s, request(kw, s.id, 0, i))
                                      for i, (s, kw) in enumerate(zip(sessions, kws))))
        await batcher.stop()
        executor.shutdown()
        return outs

    outs = asyncio.run(main())
    assert [o.request_id for o in outs] == [0, 1, 2, 3]
    assert len(calls) == 1 and calls[0].sessions == 4 and calls[0].batch == 8
