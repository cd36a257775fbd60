"""`drafter bench`'s compiled peer (drafter.tools.bench.peer) computes the engine's drafts: the same
greedy chain over the same paged calls (mixed query and context lengths, rejected tokens,
requests over several calls), for EAGLE-3 and EAGLE-1 heads; and it traces as one graph
(torch.compile fullgraph), custom attention op included.  CPU, tiny fp32 heads, the reference
attention backend on both sides."""

from __future__ import annotations

import pytest
import torch

from drafter.tools.bench.peer import CompiledPeer
from tests.support.engines import build_engine
from tests.support.scenario import Scenario

K = 3
MAX_MODEL_LEN = 64
# prefills, decode steps with rejections, a request driven to max_model_len in the last call
PLANS = [[(0, 9, 0), (1, 30, 0)], [(0, 4, 1), (1, 4, 0), (2, 3, 0)], [(0, 4, 2), (2, 4, 3), (3, 17, 0)],
         [(0, 4, 0), (1, 4, 1), (3, 4, 0)], [(1, 4, 0), (2, 4, 2), (4, 63, 0)]]


def _pair(tiny_root, head: str, compile_options):
    engine = build_engine(tiny_root, head, k=K, max_model_len=MAX_MODEL_LEN, attention_backend="reference",
                          use_cuda_graphs=False, device="cpu")
    peer = CompiledPeer(engine.head, engine.spec, engine, compile_options)
    scenario = Scenario(block_sizes=engine.limits.block_sizes, num_blocks=engine.limits.num_blocks,
                        vocab_size=engine.spec.vocab_size, hidden_width=engine.spec.hidden_input_width, k=K,
                        max_model_len=MAX_MODEL_LEN, seed=5, draft_span=engine.limits.draft_span)
    return engine, peer, scenario


def _peer_call(kwargs: dict) -> dict:
    """A scenario call as the peer takes it: every request's rejected count, even if all 0."""
    call = dict(kwargs)
    call.setdefault("num_rejected_tokens", torch.zeros_like(call["seq_lens"]))
    return call


@pytest.mark.parametrize("head", ["eagle3", "eagle"])
def test_peer_drafts_equal_the_engines(tiny_root, head):
    engine, peer, scenario = _pair(tiny_root, head, {"eager": True})
    try:
        for plan in PLANS:
            call = scenario.call(plan)
            expected = engine.propose(**call.kwargs).draft_token_ids
            got = peer.propose(_peer_call(call.kwargs))
            assert torch.equal(got, expected), f"plan {plan}: {got.tolist()} != {expected.tolist()}"
        assert torch.allclose(peer.kv_cache, engine.kv.layers[0], atol=1e-5)
    finally:
        peer.close()


def test_peer_compiles_as_one_graph(tiny_root):
    """fullgraph tracing (aot_eager: the same graph inductor would get, run by torch) gives the
    uncompiled drafts."""
    engine, peer, scenario = _pair(tiny_root, "eagle3", {"backend": "aot_eager"})
    try:
        for plan in PLANS[:2]:
            call = scenario.call(plan)
            expected = engine.propose(**call.kwargs).draft_token_ids
            assert torch.equal(peer.propose(_peer_call(call.kwargs)), expected), f"plan {plan}"
    finally:
        peer.close()
