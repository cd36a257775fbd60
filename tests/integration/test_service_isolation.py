"""Sessions interleaving their steps (and fused into shared engine calls) stay isolated.

Two sessions on one server, one over gRPC and one over ZMQ, step concurrently so that the
batcher fuses them; each must get exactly the drafts an in-process engine gives it alone.
Then one of them tries to reach outside its pool and is refused without harming the other.
"""

from __future__ import annotations

import threading

import pytest
import torch

from coordinator.transport import GrpcDrafterClient, ZmqDrafterClient
from drafter.wire.errors import Code, DrafterError
from tests.integration.conftest import SESSION_BLOCKS, reference_engine
from tests.integration.test_service_parity import plans, scenario
from tests.support.servers import layout_for


def _run_concurrently(fns):
    results, errors = [None] * len(fns), []
    start = threading.Barrier(len(fns))

    def run(i, fn):
        start.wait()  # release both steps together so that they share a batch window
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_two_sessions_interleaving_get_their_solo_drafts(eagle3_server, tiny_root):
    a = GrpcDrafterClient(eagle3_server.grpc_target, timeout_s=30)
    b = ZmqDrafterClient(eagle3_server.zmq_endpoint, timeout_s=30)
    info = a.info()
    for c in (a, b):
        c.attach(layout_for(info, SESSION_BLOCKS))
    solo_a, solo_b = reference_engine(tiny_root), reference_engine(tiny_root)
    # the same seed for both: identical block ids and tokens, so any leak between them would show
    ra, rb = scenario(solo_a, 5), scenario(solo_b, 5)
    la, lb = scenario(solo_a, 5), scenario(solo_b, 5)
    steps = list(plans())
    for i, plan in enumerate(steps):
        # B lags one step behind A: the two sessions' requests sit at different positions
        calls = [lambda p=plan: a.propose(**ra.call(p).kwargs)]
        expected = [solo_a.propose(**la.call(plan).kwargs).draft_token_ids]
        if i >= 1:
            prev = steps[i - 1]
            calls.append(lambda p=prev: b.propose(**rb.call(p).kwargs))
            expected.append(solo_b.propose(**lb.call(prev).kwargs).draft_token_ids)
        got = _run_concurrently(calls)
        for who, g, e in zip("AB", got, expected):
            assert torch.equal(g.draft_token_ids, e), f"session {who} step {i}"

    # B reaches for blocks outside its range: refused, naming the field; A's next step is unharmed.
    bad = scenario(solo_b, 6).call(steps[0]).kwargs
    bad["block_tables"] = [bad["block_tables"][0] + SESSION_BLOCKS]
    with pytest.raises(DrafterError) as e:
        b.propose(**bad)
    assert (e.value.code, e.value.field) == (Code.INVALID_ARGUMENT, "block_tables[0]")
    last = [(1, 4, 0)]
    assert torch.equal(a.propose(**ra.call(last).kwargs).draft_token_ids,
                       solo_a.propose(**la.call(last).kwargs).draft_token_ids)
    for c in (a, b):
        c.detach()
        c.close()


def test_a_detached_session_is_gone_on_both_transports(eagle3_server):
    g = GrpcDrafterClient(eagle3_server.grpc_target, timeout_s=30)
    z = ZmqDrafterClient(eagle3_server.zmq_endpoint, timeout_s=30)
    info = g.info()
    g.attach(layout_for(info, 4))
    sid, epoch = g.session.session_id, g.session.epoch
    g.detach()
    z.session.session_id, z.session.epoch = sid, epoch
    with pytest.raises(DrafterError) as e:
        z.detach()
    assert (e.value.code, e.value.field) == (Code.NOT_FOUND, "session_id")
    z.session.epoch = epoch ^ 1
    with pytest.raises(DrafterError) as e:
        z.detach()
    assert (e.value.code, e.value.field) == (Code.FAILED_PRECONDITION, "epoch")
    g.close()
    z.close()
