"""On a GPU: the Triton kernels and the CUDA-graph draft loop equal the reference backend.

Run on a GPU host:  pytest -m gpu tests/gpu
Elsewhere every test here is skipped with a message (CI has no GPU).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU host"),
]

CUDA = "cuda"


def _batch(qlens, seq_lens, *, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    from drafter.attention.metadata import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(seq_lens) // block_size) + 1
    num_blocks = len(qlens) * max_blocks + 3
    n = sum(qlens) + 5
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    table = torch.randperm(num_blocks, generator=g)[: len(qlens) * max_blocks].view(len(qlens), max_blocks).int()
    slots = torch.full((n,), -1, dtype=torch.long)
    for r, (q, s) in enumerate(zip(qlens, seq_lens)):
        for j in range(q if s else 0):
            p = s - q + j
            slots[qsl[r] + j] = table[r, p // block_size] * block_size + p % block_size
    meta = AttentionMetadata(qsl.to(CUDA), torch.tensor(seq_lens, dtype=torch.int32, device=CUDA), table.to(CUDA),
                             slots.to(CUDA), block_size)
    q = torch.randn(n, heads, head_dim, generator=g).to(CUDA, dtype)
    k = torch.randn(n, kv_heads, head_dim, generator=g).to(CUDA, dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=g).to(CUDA, dtype)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(CUDA, dtype)
    return q, k, v, cache, meta


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("shape", ["llama8b-decode", "llama8b-first-pass", "gqa2-block32"])
def test_attention_kernel_matches_reference_on_gpu(shape, window, dtype):
    from drafter.attention.reference import ReferenceBackend
    from drafter.attention.triton_backend import TritonBackend

    cases = {
        "llama8b-decode": dict(qlens=[1] * 6, seq_lens=[1, 700, 2048, 0, 65, 1500], heads=32, kv_heads=8,
                               head_dim=128, block_size=16),
        "llama8b-first-pass": dict(qlens=[4, 4, 37, 1], seq_lens=[900, 4, 2000, 33], heads=32, kv_heads=8,
                                   head_dim=128, block_size=16),
        "gqa2-block32": dict(qlens=[6, 2, 3], seq_lens=[600, 80, 3], heads=8, kv_heads=4, head_dim=64,
                             block_size=32),
    }
    q, k, v, cache, meta = _batch(**cases[shape], dtype=dtype)
    ref_cache = cache.clone()
    expected = ReferenceBackend().forward(q, k, v, ref_cache, meta, window)
    out = TritonBackend().forward(q, k, v, cache, meta, window)
    assert torch.equal(cache, ref_cache)
    assert not out.isnan().any()
    assert _rel(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)


# ---------------------------------------------------------------------- engines, tiny fp32 heads
MAX_MODEL_LEN = 96
# prefills, decode steps with rejections, and request 0 driven past max_model_len in the last call
PLANS = [[(0, 9, 0), (1, 30, 0)], [(0, 4, 1), (1, 4, 0), (2, 3, 0)], [(0, 4, 2), (2, 4, 3), (3, 17, 0)],
         [(0, 74, 0)], [(0, 4, 0), (1, 4, 1), (3, 4, 0)], [(0, 4, 0), (2, 4, 2)]]


def _scenario(engine, seed=3):
    from tests.support.scenario import Scenario

    return Scenario(block_sizes=engine.limits.block_sizes, num_blocks=engine.limits.num_blocks,
                    vocab_size=engine.spec.vocab_size, hidden_width=engine.spec.hidden_input_width,
                    k=engine.config.num_speculative_tokens, max_model_len=MAX_MODEL_LEN, seed=seed,
                    draft_span=engine.limits.draft_span)


def _cuda_kwargs(kwargs):
    return {k: ([t.to(CUDA) for t in v] if isinstance(v, list) else v.to(CUDA)) for k, v in kwargs.items()}


@pytest.mark.parametrize("head", ["eagle3", "eagle-2groups", "mtp-multi", "tree"])
def test_graph_engine_matches_reference_engine_on_gpu(tiny_root, head):
    """Reference backend (eager, on the GPU) vs Triton + fused head + CUDA graphs: same drafts, same KV."""
    from tests.support.engines import build_engine

    kw = dict(k=3, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=128, device=CUDA)
    if head == "tree":
        head, kw["speculative_token_tree"] = "eagle3", [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    ref = build_engine(tiny_root, head, attention_backend="reference", use_cuda_graphs=False, **kw)
    fast = build_engine(tiny_root, head, attention_backend="triton", **kw)
    assert fast.graphs is not None
    s_ref, s_fast = _scenario(ref), _scenario(fast)
    for plan in PLANS:
        c_ref, c_fast = s_ref.call(plan), s_fast.call(plan)
        expected = ref.propose(**_cuda_kwargs(c_ref.kwargs)).draft_token_ids
        got = fast.propose(**_cuda_kwargs(c_fast.kwargs)).draft_token_ids
        assert torch.equal(got, expected), f"plan {plan}: {got.tolist()} != {expected.tolist()}"
    assert fast.graphs.replays == len(PLANS)
    for a, b in zip(ref.kv_snapshot(), fast.kv_snapshot()):
        assert _rel(b, a) < 1e-5


GPU_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def _decode_plans(width):
    """A prefill (no decode size: the two graphs), then decode steps of width + 1 tokens per
    request (the padded drafter batch) at batch 3, 5 and 2: one combined replay each."""
    q = width + 1
    return [[(0, 30, 0), (1, 9, 0), (2, 17, 0)], [(0, q, 1), (1, q, 0), (2, q, 2)],
            [(0, q, 0), (1, q, 3), (2, q, 1), (3, q, 0), (4, q, 0)], [(1, q, 0), (4, q, 2)]]


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_combined_graph_equals_two_graphs_and_eager_on_gpu(tiny_root, shape):
    """Each call replays the combined graph, then (same call again: idempotent) the two graphs;
    both give the reference engine's drafts, each in a fresh [batch, width] tensor that later
    calls leave alone."""
    from tests.support.engines import build_engine

    kw = dict(k=3, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=128, device=CUDA)
    width = 3
    if shape == "tree":
        kw["speculative_token_tree"], width = GPU_TREE, len(GPU_TREE)
    ref = build_engine(tiny_root, "eagle3", attention_backend="reference", use_cuda_graphs=False, **kw)
    fast = build_engine(tiny_root, "eagle3", attention_backend="triton", **kw)
    runner = fast.graphs
    runner.capture()
    combined = runner.combined_graphs
    assert combined, "decode sizes captured as combined graphs"
    s_ref, s_fast = _scenario(ref), _scenario(fast)
    plans = _decode_plans(width)
    kept = []
    for plan in plans:
        expected = ref.propose(**_cuda_kwargs(s_ref.call(plan).kwargs)).draft_token_ids
        kwargs = _cuda_kwargs(s_fast.call(plan).kwargs)
        got = fast.propose(**kwargs, validate=False).draft_token_ids
        runner.combined_graphs = {}
        split = fast.propose(**kwargs, validate=False).draft_token_ids
        runner.combined_graphs = combined
        assert got.shape == (len(plan), width) and got._base is None
        assert torch.equal(got, expected), f"combined, plan {plan}: {got.tolist()} != {expected.tolist()}"
        assert torch.equal(split, expected), f"two graphs, plan {plan}: {split.tolist()} != {expected.tolist()}"
        kept.append((got, expected))
    for got, expected in kept:
        assert torch.equal(got, expected), "a later call overwrote an earlier call's drafts"
    assert runner.combined_replays == len(plans) - 1 and runner.replays == 2 * len(plans)
    for a, b in zip(ref.kv_snapshot(), fast.kv_snapshot()):
        assert _rel(b, a) < 1e-5


def test_back_to_back_calls_behind_a_busy_gpu(tiny_root):
    """Two calls queued while the GPU is still busy: the second call's header write must wait
    for the first call's graphs (the loop graph reads the output address at its end), or the
    first call would run with the second call's header.  torch.cuda._sleep only keeps the GPU
    busy so that the host runs ahead; InputHeader's wait for the DONE word the loop graph's
    last kernel sets is what the test checks."""
    from tests.support.engines import build_engine

    kw = dict(k=3, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=128, device=CUDA)
    ref = build_engine(tiny_root, "eagle3", attention_backend="reference", use_cuda_graphs=False, **kw)
    fast = build_engine(tiny_root, "eagle3", attention_backend="triton", **kw)
    fast.graphs.capture()
    s_ref, s_fast = _scenario(ref), _scenario(fast)
    prefill = [(0, 12, 0), (1, 7, 0), (2, 20, 0), (3, 5, 0)]
    ref.propose(**_cuda_kwargs(s_ref.call(prefill).kwargs))
    fast.propose(**_cuda_kwargs(s_fast.call(prefill).kwargs))
    plans = [[(0, 4, 1), (1, 4, 0)], [(2, 4, 0), (3, 4, 2)]]  # disjoint requests: order does not matter
    expected = [ref.propose(**_cuda_kwargs(s_ref.call(p).kwargs)).draft_token_ids for p in plans]
    calls = [_cuda_kwargs(s_fast.call(p).kwargs) for p in plans]
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # GPU cycles, queued ahead of both calls
    got = [fast.propose(**c, validate=False).draft_token_ids for c in calls]
    for g, e in zip(got, expected):
        assert torch.equal(g, e), f"{g.tolist()} != {e.tolist()}"


def test_graph_engine_reads_pinned_host_inputs_in_place(tiny_root):
    """The service stages calls in pinned host memory and the captured loader reads them there:
    same drafts and KV as with the call's tensors on the GPU (and a pageable call still moves)."""
    from tests.support.engines import build_engine

    kw = dict(k=3, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=128, device=CUDA)
    on_gpu = build_engine(tiny_root, "eagle-2groups", attention_backend="triton", **kw)
    pinned = build_engine(tiny_root, "eagle-2groups", attention_backend="triton", **kw)
    s_gpu, s_pinned = _scenario(on_gpu), _scenario(pinned)
    for i, plan in enumerate(PLANS):
        c_gpu, c_pin = s_gpu.call(plan), s_pinned.call(plan)

        def pin(t):
            if i % 3 == 2 and t.dim() == 2:  # pinned but strided: moved, not read through a converted copy
                return t.t().contiguous().pin_memory().t()
            return t.pin_memory() if i % 3 == 0 else t  # or pageable: moved as before

        host = {k: ([pin(t) for t in v] if isinstance(v, list) else pin(v)) for k, v in c_pin.kwargs.items()
                if v is not None}
        expected = on_gpu.propose(**_cuda_kwargs(c_gpu.kwargs)).draft_token_ids
        got = pinned.propose(**host).draft_token_ids
        assert torch.equal(got, expected), f"plan {plan}"
    for a, b in zip(on_gpu.kv_snapshot(), pinned.kv_snapshot()):
        assert torch.equal(a, b)


def test_graph_replay_equals_eager_on_8b_shapes():
    """EAGLE-3 with Llama-3.1-8B shapes in bf16: the graphs give the eager path's drafts, and the
    eager Triton path's logits stay within bf16 noise of the reference backend's."""
    from drafter.tools.bench.grid import SPECS, as_inputs, build_engine, on_device, random_head, steady_state_call
    from drafter.models.fusion import unfuse_head

    spec = SPECS["eagle3-8b"]
    head = random_head(spec, torch.device(CUDA), torch.bfloat16)
    engine = build_engine(head, spec, 3, [1, 4, 16], 1024, torch.device(CUDA))
    for b in (1, 4, 16):
        call = steady_state_call(engine, b, 1000, seed=b)
        with torch.inference_mode():
            graph_ids = engine._propose_validated(as_inputs(call, engine.device), False, False, None, None)
            eager = engine._propose_validated(as_inputs(call, engine.device), False, True, None, None)
        # the public call, trusted and validated: the same graphs, the same drafts (a call is idempotent)
        trusted = engine.propose(**on_device(call, engine.device), validate=False)
        checked = engine.propose(**on_device(call, engine.device))
        assert torch.equal(graph_ids.draft_token_ids, eager.draft_token_ids)
        assert torch.equal(trusted.draft_token_ids, eager.draft_token_ids)
        assert torch.equal(checked.draft_token_ids, eager.draft_token_ids)
        assert trusted.draft_token_ids.shape == (b, 3) and trusted.draft_token_ids._base is None
    assert engine.graphs.replays == 9
    assert engine.graphs.combined_replays == 9, "decode calls are one combined replay each"

    from drafter.attention.reference import ReferenceBackend

    ref_backend = ReferenceBackend()
    call = steady_state_call(engine, 2, 700, seed=9)
    with torch.inference_mode():
        kv = [t.clone() for t in engine.kv.layers]
        fast = engine._propose_validated(as_inputs(call, engine.device), False, True, None, None)
        for t, saved in zip(engine.kv.layers, kv):
            t.copy_(saved)
        engine.proposer.backend, engine.backend = ref_backend, ref_backend
        unfuse_head(head)  # the reference backend has no fused rotary + KV write
        ref = engine._propose_validated(as_inputs(call, engine.device), False, True, None, None)
    assert _rel(fast.draft_logits, ref.draft_logits) < 3e-2


@pytest.mark.parametrize("variant", ["picked", "swap+tma"])  # swap and tma apart: tests/unit (interpreter)
@pytest.mark.parametrize("m", [1, 7, 16, 40, 64])
@pytest.mark.parametrize("shape", ["qkv", "o", "gate_up", "down", "lm_head"])
def test_skinny_gemm_matches_cublas_on_8b_shapes(shape, m, variant):
    """The weight-streaming kernel, its picked block sizes (or the swapped MMA, or TMA loads) and
    epilogues, vs cuBLAS + torch."""
    import torch.nn.functional as F

    from drafter.kernels.fused_kernels import silu_mul
    from drafter.kernels.skinny_gemm import GemmConfig, skinny_gemm

    n, k, epilogue = {"qkv": (6144, 8192, None), "o": (4096, 4096, None), "gate_up": (28672, 4096, "silu"),
                      "down": (4096, 14336, "residual"), "lm_head": (32000, 4096, None)}[shape]
    g = torch.Generator(device=CUDA).manual_seed(m)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=CUDA, dtype=torch.bfloat16, generator=g) * k ** -0.5
    cfg = None if variant == "picked" else GemmConfig(64, 128, 4, 4, swap="swap" in variant, tma="tma" in variant)
    if epilogue == "silu":
        got, want = skinny_gemm(x, w, silu_mul=True, config=cfg), silu_mul(F.linear(x, w))
    elif epilogue == "residual":
        res = torch.randn(m, n, device=CUDA, dtype=torch.bfloat16, generator=g)
        got, want = skinny_gemm(x, w, residual=res.clone(), config=cfg), res.clone().addmm_(x, w.t())
    else:
        got, want = skinny_gemm(x, w, config=cfg), F.linear(x, w)
    assert _rel(got, want) < (2e-2 if epilogue == "silu" else 1e-2)


def test_host_stager_hands_out_pinned_views():
    """What the service stages must count as pinned, or the engine would copy it synchronously."""
    from drafter.service.batching.stage import HostStager
    from drafter.wire.records import INPUT_FIELDS, ProposeInputs

    stager = HostStager(1 << 20, pin=True)
    kw = {"target_hidden_states": torch.randn(4, 8).to(torch.bfloat16), "seq_lens": torch.arange(3, dtype=torch.int32),
          "block_tables": [torch.ones(2, 3, dtype=torch.int64)]}
    out = stager.stage(ProposeInputs(**{name: kw.get(name) for name in INPUT_FIELDS}))
    for t in (out.target_hidden_states, out.seq_lens, out.block_tables[0]):
        assert t.is_pinned()
    assert torch.equal(out.target_hidden_states, kw["target_hidden_states"])


def test_the_planner_times_the_kernel_each_input_kind_will_run(monkeypatch):
    """plan_gemm for a SiLU * up weight, with norm-weighted rows (prescaled) and without: every
    candidate is launched in that mode (not silently replaced by the cuBLAS fallback), and every
    picked config runs in the mode it was picked for and gives the normed product."""
    import torch.nn.functional as F

    from drafter.kernels import weight_gemm
    from drafter.kernels.skinny_gemm import NormedInput
    from drafter.kernels.weight_gemm import CANDIDATES, WeightGemm, plan_gemm

    launched = []

    def spy(x, weight, **kw):
        launched.append((kw["config"], isinstance(x, NormedInput) and x.scaled is not None))
        return skinny(x, weight, **kw)

    skinny = weight_gemm.skinny_gemm
    monkeypatch.setattr(weight_gemm, "skinny_gemm", spy)
    g = torch.Generator(device=CUDA).manual_seed(0)
    w = torch.randn(2 * 4096, 1024, device=CUDA, dtype=torch.bfloat16, generator=g) * 1024 ** -0.5
    norm_w = torch.rand(1024, device=CUDA, dtype=torch.bfloat16, generator=g) + 0.5
    for prescaled in (False, True):
        launched.clear()
        plan = plan_gemm(w, silu_mul=True, normed=True, prescaled=prescaled)
        assert {c for bucket in CANDIDATES for c in CANDIDATES[bucket]} <= {
            c for c, scaled in launched if scaled == prescaled}
        gemm = WeightGemm(w, {} if prescaled else plan, scaled_configs=plan if prescaled else {})
        for bucket in plan:
            x = torch.randn(bucket, 1024, device=CUDA, dtype=torch.bfloat16, generator=g)
            sumsq = (x.float() ** 2).sum(1, keepdim=True)
            inp = NormedInput(x, sumsq, norm_w, 1e-5, x * norm_w if prescaled else None)
            gate, up = F.linear(F.rms_norm(x.float(), (1024,), norm_w.float(), 1e-5).bfloat16(), w).float().chunk(2, 1)
            assert _rel(gemm(inp, silu_mul=True), F.silu(gate) * up) < 3e-2, (prescaled, bucket)


def test_attention_launch_follows_the_grid_size():
    """Few programs: long tiles, deep pipeline; a mid-size grid: 8-warp programs, two per SM (and
    splits to match); a full grid: the default tiles, unsplit (bench/probe_attention.py)."""
    from drafter.attention.triton_backend import MID_GRID_LAUNCH, SMALL_GRID_LAUNCH, AttentionLaunch, TritonBackend

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    backend, device = TritonBackend(), torch.device(CUDA)
    assert backend._launch(device, sms // 4) == SMALL_GRID_LAUNCH
    assert backend._launch(device, 2 * sms) == MID_GRID_LAUNCH
    assert backend._launch(device, 2 * sms + 1) == AttentionLaunch()
    assert backend._splits(device, 16 * 8, 1024, MID_GRID_LAUNCH) == max(1, 1 << ((2 * sms // 128).bit_length() - 1))
