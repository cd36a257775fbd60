"""On a GPU: the engine's CUDA graphs survive what other code in the process does between two
calls (issue 24): a function compiled with torch.compile(mode="reduce-overhead") (inductor's
CUDA graph trees, which free every cuBLAS workspace before they warm up or record), then
optionally torch._dynamo.reset(), torch.cuda.empty_cache(), or a second engine captured, used
and dropped.  The engine's next call must give the drafts of its first, with no illegal memory
access (before the fix it wrote into a cuBLAS workspace another graph's pool had owned, handed
back to the driver by the compiled function's recording: drafter.engine.graphs explains).

EAGLE-3 with Llama-3.1-8B shapes in bf16, the GEMM plan timed as `drafter bench` does: the graphs
run cuBLAS GEMMs (the fc over the target's hidden states always, the others where the planner
picked cuBLAS), and so keep a cuBLAS workspace's address.

Run on a GPU host:  pytest -m gpu tests/gpu/test_graph_neighbours.py
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU host"),
]

CUDA = torch.device("cuda")
BATCHES = (1, 16)  # the batch sizes; 16 x 4 tokens = 64 rows, and the loop at 16
CONTEXT = 1000


@pytest.fixture(scope="module")
def head():
    """One random 8B-shaped EAGLE-3 head for every engine here (fused and planned once)."""
    from drafter.tools.bench.grid import SPECS, random_head

    return random_head(SPECS["eagle3-8b"], CUDA, torch.bfloat16)


def _engine(head):
    from drafter.tools.bench.grid import SPECS, build_engine

    engine = build_engine(head, SPECS["eagle3-8b"], 3, list(BATCHES), 1024, CUDA)
    engine.graphs.capture()
    return engine


def _drafts(engine, calls) -> dict[int, torch.Tensor]:
    out = {b: engine.propose(**call, validate=False).draft_token_ids for b, call in calls.items()}
    torch.cuda.synchronize()  # an illegal access surfaces here, in the call that made it
    return out


def _calls(engine) -> dict[int, dict]:
    from drafter.tools.bench.grid import on_device, steady_state_call

    return {b: on_device(steady_state_call(engine, b, CONTEXT, seed=b), CUDA) for b in BATCHES}


def _foreign_graph() -> None:
    """A neighbour that captures a GEMM on torch.cuda.graph's default capture stream and drops
    the graph (a library timing its kernels, say): the cuBLAS workspace torch keeps for that
    stream now lies in the dropped graph's pool."""
    a = torch.randn(64, 4096, device=CUDA, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=CUDA, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a @ w
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a @ w
    graph.replay()
    torch.cuda.synchronize()
    del graph


def _compiled_neighbour() -> None:
    """Linear + SiLU on [16, 4096] bf16 compiled with reduce-overhead, called three times: warm-up,
    recording, replay of inductor's CUDA graph trees."""
    linear = torch.nn.Linear(4096, 4096, device=CUDA, dtype=torch.bfloat16)
    fn = torch.compile(lambda x: torch.nn.functional.silu(linear(x)), mode="reduce-overhead")
    x = torch.randn(16, 4096, device=CUDA, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            y = fn(x)
    torch.cuda.synchronize()
    assert y.shape == (16, 4096)


@pytest.mark.parametrize("neighbour", ["compiled", "compiled+dynamo_reset", "compiled+empty_cache",
                                       "compiled+second_engine"])
def test_graphs_survive_their_neighbours(head, neighbour):
    """capture, propose, a reduce-overhead compiled function x3 (+ the case's extra), propose:
    the same drafts, served by the graphs."""
    torch._dynamo.reset()  # each case warms up and records its compiled function anew
    _foreign_graph()
    engine = _engine(head)
    calls = _calls(engine)
    first = _drafts(engine, calls)
    _compiled_neighbour()
    if neighbour == "compiled+dynamo_reset":
        torch._dynamo.reset()
    elif neighbour == "compiled+empty_cache":
        torch.cuda.empty_cache()
    elif neighbour == "compiled+second_engine":
        other = _engine(head)
        theirs = _drafts(other, _calls(other))
        for b in BATCHES:  # same weights, same random KV (bench's seed), same calls
            assert torch.equal(theirs[b], first[b]), f"second engine, batch {b}"
        del other
        gc.collect()  # the graph runner and the engine reference each other
        torch.cuda.empty_cache()
    again = _drafts(engine, calls)
    for b in BATCHES:
        assert torch.equal(again[b], first[b]), f"{neighbour}, batch {b}: {again[b].tolist()} != {first[b].tolist()}"
    assert engine.graphs.replays == 2 * len(BATCHES)
