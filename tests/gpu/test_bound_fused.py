"""On a GPU: several bindings' host-ring steps fused into one engine call (drafter.service.batching.bound_steps).

Run on a GPU host:  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_bound_fused.py
Elsewhere every test here is skipped (tests/integration/test_bound_fused.py runs the same on CPU
with emulated graphs, host checks and the guard forced).

A drafter in this process (tests.integration.test_bound_remote's Drafter, a real ZMQ server on
loopback) serves an engine on cuda (Triton, CUDA graphs), so its host-ring sessions are
bound_ipc.GuardedRingSession (the frame copied to the GPU, the step guard on the GPU).  Five
sessions, bound in this order: a and b step together (the test holds the engine's lock until both
are pending), v never steps (the victim of b's bad slot), ta and tb are twins of a and b (same
history) that step alone.  Every step is padded to (16 tokens, batch 4), alone by its agreed sizes,
fused because its sums fit there: the same graph, so the fused drafts must equal the twins' bit for
bit.  Then b's step names a slot in v's blocks: refused naming slot_mappings[0], a's drafts still
its twin's, v's KV unchanged.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU host"),
]

from coordinator.transport.bound_client import HostRingClient  # noqa: E402
from drafter.engine.graphs import GraphRunner  # noqa: E402
from drafter.service import bound_ipc  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from drafter.wire.errors import Code, DrafterError  # noqa: E402
from tests.integration.test_bound_fused import TWO, _blocks, _fused, _steps  # noqa: E402
from tests.integration.test_bound_remote import (K, MAX_BATCH, MAX_MODEL_LEN, MAX_TOKENS, PADDING,  # noqa: E402
                                                 SESSION_BLOCKS, SESSIONS, Drafter, _buffers, _fill, _scenario)
from tests.support.engines import build_engine  # noqa: E402
from tests.support.servers import layout_for  # noqa: E402

WAIT_S = 120.0


class GpuTarget:
    """A HostRingClient bound to the drafter and its scenario (no reference engine: its twin is one)."""

    def __init__(self, drafter: Drafter, seed: int):
        info = drafter.core.info()
        layout = layout_for(info, SESSION_BLOCKS, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_TOKENS)
        self.client = HostRingClient(drafter.endpoint, layout, _buffers(drafter.engine), max_batch=MAX_BATCH,
                                     timeout_s=60)
        self.client.bind()
        self.scenario = _scenario(drafter.engine, seed)

    def fill(self, plan, slot: int | None = None) -> tuple[int, int]:
        n, b = _fill(self.client.views, self.scenario.call(plan).kwargs)
        if slot is not None:
            self.client.views["slot_mappings[0]"][n - 1] = slot
        return n, b

    def close(self) -> None:
        self.client.detach()
        self.client.close()


def _together(drafter: Drafter, sends) -> list:
    """Each send() run on its own thread while the test holds the engine's lock, released once all are pending."""
    import threading

    results: list = [None] * len(sends)

    def run(i, send):
        try:
            results[i] = send()
        except BaseException as exc:  # noqa: BLE001
            results[i] = exc

    lock, pending = drafter.core.executor.engine_lock, _steps(drafter)
    threads = [threading.Thread(target=run, args=(i, s), daemon=True) for i, s in enumerate(sends)]
    lock.acquire()
    try:
        for t in threads:
            t.start()
        assert pending.wait_pending(len(sends), WAIT_S), f"only {pending.pending()} of {len(sends)} steps came"
    finally:
        lock.release()
    for t in threads:
        t.join(WAIT_S)
    return results


def test_fused_guarded_steps_on_a_gpu_equal_their_twins_alone(tiny_root, monkeypatch):
    monkeypatch.setattr(bound_ipc, "GUARDED_RING", None)  # chosen by the engine's device: the GPU guard
    engine = build_engine(tiny_root, "eagle3", attention_backend="triton", device="cuda", k=K,
                          max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_TOKENS,
                          num_blocks=SESSIONS * SESSION_BLOCKS, capture_sizes=(1, 2, 4),
                          token_capture_sizes=(8, 16, 32))
    if engine.graphs is None:
        engine.graphs = GraphRunner(engine)
    engine.graphs.capture()
    with Drafter(engine) as drafter:
        a, b, v, ta, tb = targets = [GpuTarget(drafter, seed) for seed in (1, 2, 3, 1, 2)]
        try:
            sessions = drafter.server._bound_plane.sessions
            assert all(isinstance(sessions[t.client.session.session_id], bound_ipc.GuardedRingSession)
                       for t in targets)
            calls = _fused(drafter)[0]
            for plan in TWO:
                sizes = [a.fill(plan), b.fill(plan)]
                got = _together(drafter, [lambda t=t, s=s: t.client.step(*s, **PADDING) for t, s in zip((a, b), sizes)])
                alone = [t.client.step(*t.fill(plan), **PADDING) for t in (ta, tb)]
                for x, y in zip(got, alone):
                    assert isinstance(x, torch.Tensor), repr(x)
                    assert torch.equal(x, y), (plan, x, y)
            assert _fused(drafter)[0] == calls + 2, "the steps were not fused"

            victim = _blocks(engine, 2)  # v's blocks: b's bad slot is v's first one (b's range ends there)
            plan = [(0, K + 1, 0), (1, K + 1, 1)]
            sizes = [a.fill(plan), b.fill(plan, slot=SESSION_BLOCKS * engine.limits.block_sizes[0])]
            got = _together(drafter, [lambda t=t, s=s: t.client.step(*s, **PADDING) for t, s in zip((a, b), sizes)])
            assert isinstance(got[1], DrafterError) and got[1].code == Code.INVALID_ARGUMENT, repr(got[1])
            assert got[1].field == "slot_mappings[0]", str(got[1])
            expected = ta.client.step(*ta.fill(plan), **PADDING)
            assert isinstance(got[0], torch.Tensor) and torch.equal(got[0], expected), repr(got[0])
            assert _fused(drafter)[0] == calls + 3, "masked, the bad step ran in the fused call"
            assert all(torch.equal(x, y) for x, y in zip(victim, _blocks(engine, 2))), "wrote into v's KV"
        finally:
            for t in targets:
                t.close()
