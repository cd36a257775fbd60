"""Fairness and quotas between clients (issue 19, item 4), without a network: the fair queue's
round-robin, the engine thread forming batches from it, the per-client in-flight cap, the per-client
session and KV-block quotas, the re-attach that replaces a client's own session, and the owner check
on the propose path."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from drafter.service.batching.fair import FairQueue
from drafter.service.batching.queue import Batcher, EngineThread, Pending
from drafter.service.config import ServerConfig
from drafter.service.core import InflightLimit
from drafter.service.sessions import ClientQuotas, SessionTable
from drafter.wire import schema
from drafter.wire.errors import Code, DrafterError
from drafter.wire.records import Caller
from tests.support.requests import request
from tests.unit.test_service_sessions import ENG, layout


def _call(rid: int, client: str = "", batch: int = 1):
    kw = {"next_token_ids": torch.zeros(batch, dtype=torch.int64), "target_token_ids": torch.zeros(batch)}
    call = request(kw, "s", 0, rid)
    call.caller = Caller(connection=client)
    return call


def _pending(rid: int, client: str, batch: int = 1) -> Pending:
    return Pending(None, _call(rid, client, batch), None, client=client)


def _ids(items) -> list[int]:
    return [it.call.request_id for it in items]


# ------------------------------------------------------------------ the fair queue
def test_round_robin_across_clients_keeps_each_clients_order():
    fair = FairQueue()
    for rid in range(1, 7):  # a flooder's backlog first, then a well-behaved client's one request
        fair.push(_pending(rid, "flood"))
    fair.push(_pending(100, "good"))
    assert _ids(fair.take(max_batch=2, max_tokens=64)) == [1, 100], "the good client is in the next batch"
    assert _ids(fair.take(max_batch=4, max_tokens=64)) == [2, 3, 4, 5], "one client alone: its own order"
    fair.push(_pending(101, "good"))
    fair.push(_pending(200, "third"))
    assert _ids(fair.take(max_batch=8, max_tokens=64)) == [6, 101, 200]
    assert not fair and fair.rows == 0 and fair.tokens == 0


def test_a_client_that_does_not_fit_goes_first_next_time():
    fair = FairQueue()
    fair.push(_pending(1, "a", batch=2))
    fair.push(_pending(2, "big", batch=4))
    fair.push(_pending(3, "c", batch=1))
    assert _ids(fair.take(max_batch=4, max_tokens=64)) == [1, 3], "the 4-row request waits, the rest fill up"
    fair.push(_pending(4, "a", batch=1))
    assert _ids(fair.take(max_batch=4, max_tokens=64)) == [2], "then it leads"
    assert _ids(fair.take(max_batch=4, max_tokens=64)) == [4]


def test_tokens_bound_a_batch_too():
    fair = FairQueue()
    fair.push(_pending(1, "a", batch=3))  # 3 tokens each
    fair.push(_pending(2, "b", batch=3))
    fair.push(_pending(3, "c", batch=3))
    assert _ids(fair.take(max_batch=16, max_tokens=6)) == [1, 2]
    assert fair.tokens == 3 and fair.rows == 3


# ------------------------------------------------------------------ the engine thread
class _Runner:
    max_batch, max_tokens = 2, 64

    def __init__(self):
        self.batches: list[list[int]] = []
        self.defer_records = False

    def run_batch(self, items):
        self.batches.append(_ids(items))
        return [it.call.request_id for it in items]

    def flush_records(self):
        pass


def test_the_engine_thread_batches_round_robin_behind_a_backlog():
    """FIFO would run the good client's request after the flooder's whole backlog (4 engine calls later);
    round-robin runs it in the first batch formed once it is queued."""
    runner, engine = _Runner(), EngineThread("test-engine")

    async def main():
        batcher = Batcher(runner, engine, window_s=0.0)
        batcher.start()
        gate = threading.Event()
        loop = asyncio.get_running_loop()
        blocked = loop.run_in_executor(engine, gate.wait)  # holds the engine thread while the queue fills
        futs = []
        for rid, client in [(rid, "flood") for rid in range(1, 9)] + [(100, "good")]:
            fut = loop.create_future()
            futs.append(fut)
            batcher.submit_nowait(None, _call(rid, client), fut.set_result)  # posted before this returns
        gate.set()
        await blocked
        results = await asyncio.gather(*futs)
        await batcher.stop()
        return results

    results = asyncio.run(main())
    engine.shutdown()
    assert results == [*range(1, 9), 100]
    assert runner.batches[0] == [1, 100], runner.batches
    assert [r for b in runner.batches for r in b if r != 100] == list(range(1, 9)), "the flooder's own order"


def test_a_stopped_batcher_answers_its_backlog():
    runner, engine = _Runner(), EngineThread("test-engine")

    async def main():
        batcher = Batcher(runner, engine, window_s=0.0)
        batcher.start()
        left = asyncio.get_running_loop().create_future()
        batcher.fair.push(Pending(None, _call(7, "x"), left, loop=asyncio.get_running_loop(), client="x"))
        # the backlog belongs to the engine thread: hold it so stop() runs before it looks at the backlog
        gate = threading.Event()
        blocked = asyncio.get_running_loop().run_in_executor(engine, gate.wait)
        await batcher.stop()
        gate.set()
        await blocked
        with pytest.raises(DrafterError) as e:
            await left
        return e.value.code

    assert asyncio.run(main()) == Code.UNAVAILABLE
    engine.shutdown()


# ------------------------------------------------------------------ the in-flight cap
def test_inflight_cap_refuses_at_once_and_frees_on_leave():
    cap = InflightLimit(2)
    cap.enter("a")
    cap.enter("a")
    with pytest.raises(DrafterError) as e:
        cap.enter("a")
    assert e.value.code == Code.RESOURCE_EXHAUSTED and "--max-inflight-per-client 2" in e.value.message
    cap.enter("b")  # another client is not held back
    cap.leave("a")
    cap.enter("a")
    for client in ("a", "a", "b"):
        cap.leave(client)
    assert cap.calls == {}


# ------------------------------------------------------------------ attach quotas, replacement, ownership
ALICE, BOB = Caller(peer="x509:alice", connection="grpc:1"), Caller(peer="x509:bob", connection="grpc:2")


def test_session_quota_per_client_counts_connections_without_auth():
    table = SessionTable(ENG, max_sessions=8, quotas=ClientQuotas(max_sessions=1))
    conn = Caller(connection="zmq-tcp:00aa")
    table.attach(layout(client_name="w0"), conn)
    with pytest.raises(DrafterError) as e:
        table.attach(layout(client_name="w1"), conn)
    assert (e.value.code, e.value.field) == (Code.RESOURCE_EXHAUSTED, "session")
    assert "--max-sessions-per-client 1" in e.value.message
    table.attach(layout(client_name="w1"), Caller(connection="zmq-tcp:00bb"))  # another connection


def test_kv_block_quota_per_client_and_group():
    table = SessionTable(ENG, max_sessions=8, quotas=ClientQuotas(max_kv_blocks=(50, 0)))
    def groups(a: int, b: int) -> list[schema.KVGroup]:
        return [schema.KVGroup(block_size=16, num_blocks=a), schema.KVGroup(block_size=8, num_blocks=b)]
    table.attach(layout(kv_groups=groups(30, 20)), ALICE)
    with pytest.raises(DrafterError) as e:
        table.attach(layout(kv_groups=groups(21, 5)), ALICE)
    assert (e.value.code, e.value.field) == (Code.RESOURCE_EXHAUSTED, "kv_groups[0].num_blocks")
    assert "--max-kv-blocks-per-client 50" in e.value.message
    table.attach(layout(kv_groups=groups(20, 30)), ALICE)  # exactly the quota of group 0; group 1 unlimited
    table.attach(layout(kv_groups=groups(40, 5)), BOB)
    assert table.free_blocks() == [10, 5]


def test_a_block_quota_per_group_must_match_the_groups():
    with pytest.raises(ValueError, match="--max-kv-blocks-per-client"):
        SessionTable(ENG, max_sessions=8, quotas=ClientQuotas(max_kv_blocks=(1, 2, 3)))


def test_replaceable_is_the_same_peers_quiet_session_of_the_same_name():
    table = SessionTable(ENG, max_sessions=8, quotas=ClientQuotas(replace_idle_s=30.0))
    old = table.attach(layout(client_name="dp0"), ALICE)
    table.attach(layout(client_name="dp1"), ALICE)
    table.attach(layout(client_name="dp0"), BOB)
    later = old.last_used + 30.0
    assert table.replaceable(layout(client_name="dp0"), ALICE, now=later) is old
    assert table.replaceable(layout(client_name="dp0"), ALICE, now=later - 0.1) is None, \
        "a session in use (a live replica sharing certificate and name) is not taken"
    assert table.replaceable(layout(client_name="dp2"), ALICE, now=later) is None
    assert table.replaceable(layout(client_name="dp0"), Caller(peer="x509:eve"), now=later) is None
    assert table.replaceable(layout(client_name=""), ALICE, now=later) is None, "an unnamed session is never replaced"
    with pytest.raises(DrafterError) as e:  # a layout it cannot serve is refused before anything is replaced
        table.replaceable(layout(client_name="dp0", max_model_len=128), ALICE, now=later)
    assert e.value.field == "max_model_len"
    conn = Caller(connection="grpc:ipv4:127.0.0.1:4000")
    table.release(table.detach(old.id, ALICE.peer))
    table.attach(layout(client_name="dp9"), conn)
    assert table.replaceable(layout(client_name="dp9"), conn, now=later) is None, "without auth nothing is replaced"


def test_an_owned_session_does_not_exist_for_another_peer():
    table = SessionTable(ENG, max_sessions=8)
    s = table.attach(layout(), ALICE)
    assert table.owned(s.id, ALICE.peer) is s
    for other in (BOB.peer, ""):
        with pytest.raises(DrafterError) as e:
            table.owned(s.id, other)
        assert (e.value.code, e.value.field) == (Code.NOT_FOUND, "session_id")
    anyone = table.attach(layout(), Caller(connection="zmq-tcp:01"))
    assert table.owned(anyone.id, "") is anyone and table.owned(anyone.id, BOB.peer) is anyone


# ------------------------------------------------------------------ the flags
def test_quota_flags_are_validated_and_reach_the_core():
    cfg = ServerConfig(method="eagle3", model="/m", max_sessions_per_client=2, max_kv_blocks_per_client="64,32",
                       max_inflight_per_client=16)
    cfg.check()
    assert cfg.client_quotas() == ClientQuotas(max_sessions=2, max_kv_blocks=(64, 32), max_inflight=16,
                                               replace_idle_s=30.0)
    assert ServerConfig().max_inflight_per_client > 0, "a cap by default: never unbounded queueing"
    for bad in (dict(max_inflight_per_client=-1), dict(max_sessions_per_client=-1),
                dict(max_kv_blocks_per_client="many"), dict(max_kv_blocks_per_client="-3"), dict(replace_idle_s=-1)):
        with pytest.raises(ValueError, match="--" + next(iter(bad)).replace("_", "-")):
            ServerConfig(method="eagle3", model="/m", **bad).check()


def test_a_backlog_is_answered_when_the_batcher_stops_and_the_thread_shuts_down_at_once():
    """core.close(): Batcher.stop() then shutdown(cancel_futures=True), which drops the queue's jobs."""
    runner, engine = _Runner(), EngineThread("test-engine")

    async def main():
        loop = asyncio.get_running_loop()
        batcher = Batcher(runner, engine, window_s=0.0)
        batcher.start()
        gate, entered = threading.Event(), threading.Event()
        blocked = loop.run_in_executor(engine, lambda: (entered.set(), gate.wait()))
        assert entered.wait(30), "the engine thread is held (so shutdown cannot cancel the holding job)"
        left = loop.create_future()
        batcher.fair.push(Pending(None, _call(9, "x"), left, loop=loop, client="x"))
        await batcher.stop()
        engine.shutdown(wait=False, cancel_futures=True)
        gate.set()
        await blocked
        with pytest.raises(DrafterError) as e:
            await asyncio.wait_for(left, 60)  # a backlog left unanswered would hang its callers
        return e.value.code

    assert asyncio.run(main()) == Code.UNAVAILABLE
