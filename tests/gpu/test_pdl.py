"""On a Hopper GPU: kernels launched with programmatic dependent launch (drafter.pdl), with and
without the L2 weight prefetch, compute exactly what plain launches compute, eagerly and inside
CUDA graphs.  PDL only moves when a kernel may start, never what it reads: results are bitwise equal.

Run on a GPU host:  pytest -m gpu tests/gpu
"""

from __future__ import annotations

import pytest
import torch

from drafter import pdl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not pdl.supported(torch.device("cuda")),
                       reason="needs a Hopper (sm_90+) CUDA device: run on a GPU host"),
]

CUDA = torch.device("cuda")
MB = 1 << 20


@pytest.mark.parametrize("prefetch_per_row", [0, 256, 1 << 20])
@pytest.mark.parametrize("epilogue", [None, "silu", "residual"])
def test_skinny_gemm_with_pdl_is_bitwise_plain(epilogue, prefetch_per_row):
    from drafter.models.skinny_gemm import skinny_gemm

    g = torch.Generator(device=CUDA).manual_seed(7)
    n, k, m = 4096, 4096, 5
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16, generator=g)
    w = torch.randn(2 * n if epilogue == "silu" else n, k, device=CUDA, dtype=torch.bfloat16, generator=g)
    res = torch.randn(m, n, device=CUDA, dtype=torch.bfloat16, generator=g)
    kw = dict(silu_mul=epilogue == "silu")
    plain = skinny_gemm(x, w, residual=res.clone() if epilogue == "residual" else None, **kw)
    fast = skinny_gemm(x, w, residual=res.clone() if epilogue == "residual" else None, pdl=True,
                       prefetch_bytes=prefetch_per_row, **kw)
    assert torch.equal(plain, fast)


def test_engine_graphs_with_pdl_and_prefetch_equal_plain_launches():
    """EAGLE-3 with Llama-3.1-8B shapes: drafts and KV writes of the PDL graphs (with prefetch)
    equal those of plain launches, over several batch sizes and a second call on the same KV."""
    from drafter.bench import SPECS, as_inputs, build_engine, random_head, steady_state_call
    from drafter.models.weight_gemm import WeightGemm

    spec = SPECS["eagle3-8b"]
    head = random_head(spec, CUDA, torch.bfloat16)
    engine = build_engine(head, spec, 3, [1, 4, 16], 1024, CUDA)
    assert engine.pdl, "pdl=auto must switch PDL on on a Hopper device"
    calls = [steady_state_call(engine, b, 1000, seed=b) for b in (1, 4, 16)]
    kv0 = [t.clone() for t in engine.kv.layers]

    def run():
        for t, saved in zip(engine.kv.layers, kv0):
            t.copy_(saved)
        with torch.inference_mode():
            ids = [engine._propose_validated(as_inputs(c, CUDA), False, False, None, None).draft_token_ids.clone()
                   for c in calls]
        return ids, [t.clone() for t in engine.kv.layers]

    def relaunch(on: bool, prefetch: int):
        from drafter.graphs import GraphRunner

        engine.backend.pdl = on
        for m in head.modules():
            m.pdl = on
            for g in vars(m).values():
                if isinstance(g, WeightGemm):
                    g.pdl, g.prefetch_bytes = on, prefetch if on else 0
        engine.graphs = GraphRunner(engine)

    with_pdl, kv_pdl = run()
    relaunch(True, 8 * MB)
    with_prefetch, kv_prefetch = run()
    relaunch(False, 0)
    plain, kv_plain = run()
    for a, b, c in zip(plain, with_pdl, with_prefetch):
        assert torch.equal(a, b) and torch.equal(a, c)
    for a, b, c in zip(kv_plain, kv_pdl, kv_prefetch):
        assert torch.equal(a, b) and torch.equal(a, c)
