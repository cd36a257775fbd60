"""The Triton kernels against the reference backend and the torch code they replace.

Without a GPU they run under the Triton interpreter (TRITON_INTERPRET=1, set here before any
kernel is defined); with one, on it.  Shapes are tiny: the interpreter runs one program at a
time in Python.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")

from drafter.attention.metadata import AttentionMetadata  # noqa: E402
from drafter.attention.reference import ReferenceBackend  # noqa: E402
from drafter.attention.triton_backend import AttentionLaunch, TritonBackend  # noqa: E402
from drafter.engine.graphs import GraphRunner  # noqa: E402
from drafter.kernels import fused_kernels as K  # noqa: E402
from drafter.models.layers import RMSNorm, apply_rope  # noqa: E402
from tests.support.engines import build_engine  # noqa: E402
from tests.support.scenario import Scenario  # noqa: E402
from tests.support.triton_bounds import allowing, allowing_outputs  # noqa: E402
from tests.support.triton_bounds import bounds_checked  # noqa: E402,F401 - an autouse fixture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(qlens, seq_lens, *, heads=4, kv_heads=2, head_dim=16, block_size=8, num_blocks=40, max_blocks=8,
           extra_rows=3, seed=0):
    """Random q/k/v, a random paged cache, and metadata for requests with these query and
    sequence lengths; `extra_rows` padding rows after the last request belong to none."""
    g = torch.Generator().manual_seed(seed)
    n = sum(qlens) + extra_rows
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in qlens]).int()
    slots = torch.full((n,), -1, dtype=torch.long)
    for r, (q, s) in enumerate(zip(qlens, seq_lens)):
        for j in range(q if s else 0):
            p = s - q + j
            slots[qsl[r] + j] = table[r, p // block_size] * block_size + p % block_size
    meta = AttentionMetadata(qsl, torch.tensor(seq_lens, dtype=torch.int32), table, slots, block_size)
    q = torch.randn(n, heads, head_dim, generator=g)
    k = torch.randn(n, kv_heads, head_dim, generator=g)
    v = torch.randn(n, kv_heads, head_dim, generator=g)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    return q, k, v, cache, meta


def _to(device, *tensors):
    return [t.to(device) for t in tensors]


def _meta_to(meta: AttentionMetadata, device) -> AttentionMetadata:
    return AttentionMetadata(*_to(device, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.slot_mapping),
                             meta.block_size,
                             None if meta.tree_mask is None else meta.tree_mask.to(device),
                             None if meta.tree_depths is None else meta.tree_depths.to(device))


CASES = {
    # mixed query lengths (a prefill over several pages, a decode row, a short query), padding rows after
    "mixed": dict(qlens=[3, 1, 9], seq_lens=[10, 1, 40]),
    # one row per request, a padded request (seq_len 0) in the middle: reads and writes nothing
    "decode": dict(qlens=[1, 1, 1, 1], seq_lens=[17, 0, 33, 64], extra_rows=0),
    # padded requests with no query rows at all (the first pass's padding to the batch capture size)
    "empty-requests": dict(qlens=[0, 2, 0], seq_lens=[0, 5, 0]),
    "mha": dict(qlens=[2, 5], seq_lens=[9, 30], kv_heads=4),
    "mqa-block16": dict(qlens=[4, 1], seq_lens=[50, 3], kv_heads=1, block_size=16, num_blocks=20, max_blocks=4),
}


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_matches_reference(case, window, splits):
    q, k, v, cache, meta = _batch(**CASES[case])
    ref_cache = cache.clone()
    expected = ReferenceBackend().forward(q, k, v, ref_cache, meta, window)
    q, k, v, cache = _to(DEVICE, q, k, v, cache)
    # 16-key tiles: the 64 keys of a block table make 4 tiles, so splits=4 really splits
    out = TritonBackend(num_splits=splits, launch=AttentionLaunch(block_n=16)).forward(
        q, k, v, cache, _meta_to(meta, DEVICE), window)
    assert torch.equal(cache.cpu(), ref_cache), "the KV write differs"
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_tree_attention_matches_reference(window):
    # 2 requests, 5 tree nodes already in the cache, this level's 2 nodes query: node 3 descends
    # from node 0, node 4 from node 1; their positions are context end + depth
    mask = torch.tensor([[1, 0, 0, 1, 0], [0, 1, 0, 0, 1]], dtype=torch.bool)
    depths = torch.tensor([1, 1, 1, 2, 2])
    q, k, v, cache, meta = _batch([2, 2], [12, 20], extra_rows=0)
    meta.tree_mask, meta.tree_depths = mask, depths
    ref_cache = cache.clone()
    expected = ReferenceBackend().forward(q, k, v, ref_cache, meta, window)
    q, k, v, cache = _to(DEVICE, q, k, v, cache)
    out = TritonBackend(num_splits=2).forward(q, k, v, cache, _meta_to(meta, DEVICE), window)
    assert torch.equal(cache.cpu(), ref_cache)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_attention_is_not_trivially_equal():
    """The comparison above can fail: a different mask gives a different answer."""
    q, k, v, cache, meta = _batch(**CASES["mixed"])
    expected = ReferenceBackend().forward(q, k, v, cache.clone(), meta, None)
    q, k, v, cache = _to(DEVICE, q, k, v, cache)
    out = TritonBackend(num_splits=1).forward(q, k, v, cache, _meta_to(meta, DEVICE), 2)
    assert not torch.allclose(out.cpu(), expected, atol=1e-3)


def test_rope_write_matches_rotary_then_reference():
    heads, kv_heads, d = 4, 2, 16
    q, k, v, cache, meta = _batch([3, 1, 4], [7, 1, 20], heads=heads, kv_heads=kv_heads, head_dim=d)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip([3, 1, 4], [7, 1, 20])] + [torch.zeros(3)]).long()
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    theta = 500.0
    ref_cache = cache.clone()
    expected = ReferenceBackend().forward(apply_rope(q, positions, theta), apply_rope(k, positions, theta), v,
                                          ref_cache, meta, None)
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    qkv, positions, inv_freq, cache = _to(DEVICE, qkv, positions, inv_freq, cache)
    out = TritonBackend().forward_rope(qkv, positions, inv_freq, heads, cache, _meta_to(meta, DEVICE))
    torch.testing.assert_close(cache.cpu(), ref_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norms_and_silu_match_torch(dtype):
    g = torch.Generator().manual_seed(1)
    rows, n, vocab = 5, 48, 30
    x, res, hidden = (torch.randn(rows, n, generator=g).to(dtype) for _ in range(3))
    norm, norm2 = RMSNorm(n, 1e-5).to(dtype), RMSNorm(n, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(n, generator=g))
        norm2.weight.copy_(1 + 0.1 * torch.randn(n, generator=g))
    table = torch.randn(vocab, n, generator=g).to(dtype)
    ids = torch.randint(0, vocab, (rows,), generator=g)
    gate_up = torch.randn(rows, 2 * n, generator=g).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    with torch.no_grad():
        dx, dres, dh, dtable, dids, dgu = _to(DEVICE, x, res, hidden, table, ids, gate_up)
        w, w2 = norm.weight.to(DEVICE), norm2.weight.to(DEVICE)
        torch.testing.assert_close(K.rms_norm(dx, w, 1e-5).cpu(), norm(x), **tol)
        normed, total = K.rms_norm(dx, w, 1e-5, residual=dres)
        torch.testing.assert_close(total.cpu(), x + res, **tol)
        torch.testing.assert_close(normed.cpu(), norm(x + res), **tol)
        dual = K.embed_dual_norm(dids, dtable, dh, w, w2, 1e-5).cpu()
        torch.testing.assert_close(dual, torch.cat([norm(table[ids]), norm2(hidden)], dim=1), **tol)
        gate, up = gate_up.chunk(2, dim=1)
        torch.testing.assert_close(K.silu_mul(dgu).cpu(), torch.nn.functional.silu(gate) * up, **tol)


@pytest.mark.parametrize("vocab", [300, 70000])  # one chunk; several chunks with the best in a later one
def test_greedy_ids_match_argmax_and_d2t(vocab):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, vocab, generator=g)
    logits[0, 5] = logits[0, vocab - 2] = 50.0  # a tie: the first index wins, as torch.argmax
    logits[2, vocab - 1] = 60.0
    d2t = torch.randint(0, 1000, (vocab,), generator=g)
    want = logits.argmax(-1)
    got = K.greedy_ids(logits.to(DEVICE)).cpu()
    assert torch.equal(got, want) and int(got[0]) == 5
    assert torch.equal(K.greedy_ids(logits.to(DEVICE), d2t.to(DEVICE)).cpu(), want + d2t[want])


def test_step_inputs_match_the_torch_path():
    """TritonBackend.decode_step_inputs against the proposer's own torch code."""
    from drafter.kernels.step_inputs import decode_step_inputs
    from drafter.engine.buffers import StaticBuffers
    from drafter.engine.proposer import Proposer

    block_sizes = (4, 8)
    buf = StaticBuffers(16, 6, 8, (6, 3), block_sizes, "cpu", torch.float32)
    g = torch.Generator().manual_seed(2)
    for t in buf.block_tables:
        t.copy_(torch.randint(0, 50, t.shape, generator=g, dtype=torch.int32))
    buf.seq_lens[:6] = torch.tensor([5, 0, 19, 20, 3, 0], dtype=torch.int32)  # rows 1 and 5 padded
    pos = torch.tensor([4, 0, 18, 19, 22, 7])  # row 3 reaches max_model_len 20, row 4 is past it
    proposer = Proposer(None, [], ReferenceBackend(), 4, 20, None)  # k = 4: three chain steps
    real = buf.seq_lens[:6] > 0
    want = proposer._chain_step_inputs(buf, 6, pos, real)  # the torch path, one step after another
    tables = [t[:6].to(DEVICE) for t in buf.block_tables]
    got = decode_step_inputs(pos.to(DEVICE), buf.seq_lens[:6].to(DEVICE), tables, block_sizes, 20, steps=3)
    assert len(got) == len(want) == 3
    for (got_pos, got_fed, got_metas), (want_pos, want_fed, want_metas) in zip(got, want):
        assert torch.equal(got_pos.cpu(), want_pos) and torch.equal(got_fed.cpu(), want_fed)
        for g, w in zip(got_metas, want_metas):
            assert torch.equal(g.seq_lens.cpu(), w.seq_lens)
            assert torch.equal(g.slot_mapping.cpu(), w.slot_mapping)
            assert torch.equal(g.query_start_loc.cpu(), w.query_start_loc)
    first_metas = want[0][2]
    assert int(first_metas[0].slot_mapping[1]) == -1 and int(first_metas[0].slot_mapping[3]) == -1
    assert int(want[2][2][0].slot_mapping[0]) != -1  # row 0 stays live through the three steps


@pytest.mark.parametrize("rejection,wide,strided", [
    ("none", False, False), ("explicit-sample", False, False), ("rejected-counts", False, False),
    ("none", True, False), ("explicit-sample", True, False), ("rejected-counts", True, False),
    ("explicit-sample", False, True)], ids=lambda v: str(v))
def test_header_loader_matches_buffers_load(tiny_root, rejection, wide, strided):
    """The graph-side loader (header of addresses + loader kernels) leaves the buffers as
    StaticBuffers.load does, up to the padded sizes, for int32 and int64 inputs, and for
    strided views (which the header converts)."""
    from drafter.kernels.batch_inputs import InputHeader, load_inputs
    from drafter.wire.records import ProposeInputs

    engine = build_engine(tiny_root, "eagle-2groups", max_model_len=MAX_MODEL_LEN, max_num_seqs=6,
                          max_num_batched_tokens=32)
    scn = _scenario(engine)
    scn.call([(0, 5, 0), (1, 3, 0), (2, 6, 0)])
    call = scn.call([(0, 4, 2), (1, 4, 0), (2, 4, 1)], padded=rejection == "explicit-sample")
    kw = dict(call.kwargs)
    if rejection == "none":
        kw.pop("num_rejected_tokens", None)
    inp = ProposeInputs(kw["target_token_ids"], kw["target_positions"], kw["target_hidden_states"],
                        kw["next_token_ids"], kw["query_start_loc"], kw["seq_lens"], kw["block_tables"],
                        kw["slot_mappings"], kw.get("token_indices_to_sample"), kw.get("num_rejected_tokens"))
    assert (inp.token_indices_to_sample is not None) == (rejection == "explicit-sample")
    want = engine.buffers
    want.load(inp, 16, 6)
    got = StaticBuffersLike(want, DEVICE)
    dev_inp = ProposeInputs(*[_dev(getattr(inp, f), wide, strided) for f in ProposeInputs.__dataclass_fields__])
    header = InputHeader(2, DEVICE)
    header.write(dev_inp, torch.empty(inp.batch_size, 3, dtype=torch.int64, device=DEVICE))
    tensors = [t for v in vars(dev_inp).values() if v is not None for t in (v if isinstance(v, list) else [v])]
    assert bool(header.inputs[2]) == strided, "strided views, and only they, are converted"
    with allowing(tensors + header.inputs[2]):
        load_inputs(header.device, got, 16, 6)
    n = inp.num_tokens
    for name in ("input_ids", "positions"):
        assert torch.equal(getattr(got, name)[:16].cpu(), getattr(want, name)[:16]), name
    assert torch.equal(got.hidden[:n].cpu(), want.hidden[:n])
    assert torch.equal(got.query_start_loc[:7].cpu(), want.query_start_loc[:7])
    assert torch.equal(got.seq_lens[:6].cpu(), want.seq_lens[:6])
    assert torch.equal(got.sample_indices[:6].cpu(), want.sample_indices[:6])
    b = inp.batch_size
    for g in range(2):
        assert torch.equal(got.slot_mappings[g][:16].cpu(), want.slot_mappings[g][:16])
        # the call's own rows and columns; the rest is never read and stays as it was
        width = inp.block_tables[g].shape[1]
        assert torch.equal(got.block_tables[g][:b, :width].cpu(), want.block_tables[g][:b, :width])
        assert bool((got.block_tables[g][b:] == 7).all())


def _dev(value, wide=False, strided=False):
    if isinstance(value, list):
        return [_dev(t, wide, strided) for t in value]
    if value is None:
        return None
    if not value.is_floating_point():
        value = value.to(torch.int64 if wide else torch.int32)
    value = value.to(DEVICE)
    if strided:  # every other element of the last dimension of a tensor twice as wide
        value = torch.stack([value, torch.full_like(value, -5)], dim=-1).flatten(-2)[..., ::2]
    return value


class StaticBuffersLike:
    """Buffers shaped like `like`'s, filled with junk the loader must overwrite."""

    def __init__(self, like, device):
        def junk(t):
            return torch.full_like(t, 7, device=device) if t.dtype != torch.float32 else torch.randn_like(t, device=device)
        for name in ("input_ids", "positions", "hidden", "query_start_loc", "seq_lens", "sample_indices"):
            setattr(self, name, junk(getattr(like, name)))
        self.block_tables = [junk(t) for t in like.block_tables]
        self.slot_mappings = [junk(t) for t in like.slot_mappings]


# ---------------------------------------------------------------------- whole engine
MAX_MODEL_LEN = 48
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
SKINNY_AROUND = "on" if DEVICE == "cuda" else "off"  # tests of what runs around the weight GEMMs


def _engines(root, head, *, graphs=False, skinny="on", **config):
    """skinny: the fused head's weight GEMMs ("off": torch's).  The eager engines below run the skinny
    kernel; the graph and tree engines, whose subject is the data flow around it, skip it on CPU, where
    the interpreted kernel was ~60% of their time."""
    kw = dict(k=3, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=32, skinny_gemm=skinny,
              **config)
    ref = build_engine(root, head, **kw)
    fast = build_engine(root, head, attention_backend="triton", device=DEVICE, **kw)
    assert fast.backend.name == "triton"
    if graphs and DEVICE == "cpu":
        fast.graphs = GraphRunner(fast, emulate=True)
    return ref, fast


def _scenario(engine):
    return Scenario(block_sizes=engine.limits.block_sizes, num_blocks=engine.limits.num_blocks,
                    vocab_size=engine.spec.vocab_size, hidden_width=engine.spec.hidden_input_width,
                    k=engine.config.num_speculative_tokens, max_model_len=MAX_MODEL_LEN, seed=3,
                    draft_span=engine.limits.draft_span)


# a prefill, decode steps with rejections, and request 0 driven past max_model_len
PLANS = [[(0, 9, 0), (1, 20, 0)], [(0, 4, 1), (1, 4, 0), (2, 3, 0)], [(0, 4, 2), (2, 4, 3)],
         [(0, 30, 0)], [(0, 4, 0), (1, 4, 1)]]


def _compare(ref, fast, plans, **kw):
    s_ref, s_fast = _scenario(ref), _scenario(fast)
    for plan in plans:
        c_ref, c_fast = s_ref.call(plan, **kw), s_fast.call(plan, **kw)
        expected = ref.propose(**c_ref.kwargs).draft_token_ids
        kwargs = {k: ([t.to(DEVICE) for t in v] if isinstance(v, list) else v.to(DEVICE))
                  for k, v in c_fast.kwargs.items()}
        outputs = allowing_outputs(fast.graphs) if fast.graphs is not None else contextlib.nullcontext()
        with allowing([t for v in kwargs.values() for t in (v if isinstance(v, list) else [v])]), outputs:
            got = fast.propose(**kwargs).draft_token_ids
        assert torch.equal(got.cpu(), expected), f"plan {plan}: {got.tolist()} != {expected.tolist()}"
    for a, b in zip(ref.kv_snapshot(), fast.kv_snapshot()):
        torch.testing.assert_close(b.cpu(), a, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head", ["eagle3", "eagle-2groups"])
def test_engine_on_triton_matches_reference_engine(tiny_root, head):
    """Fused head + Triton kernels, eager: same drafts and same KV as the reference engine (EAGLE-3
    with the skinny GEMMs; the two KV groups' head is about its attention layers, see SKINNY_AROUND)."""
    ref, fast = _engines(tiny_root, head, skinny="on" if head == "eagle3" else SKINNY_AROUND)
    _compare(ref, fast, PLANS)


def test_engine_graph_path_matches_reference_engine(tiny_root):
    """The graph runner's data flow (first pass keyed by tokens, loop by batch, static hand-off);
    on CPU the 'graphs' are replays of the captured functions."""
    ref, fast = _engines(tiny_root, "mtp-multi", graphs=True, skinny=SKINNY_AROUND, capture_sizes=(2, 4),
                         token_capture_sizes=(16, 32))
    _compare(ref, fast, PLANS)
    assert fast.graphs.replays == len(PLANS)
    assert sorted(fast.graphs.loop_graphs) == [2, 4] and sorted(fast.graphs.first_graphs) == [16, 32]


def test_tree_on_triton_matches_reference_engine(tiny_root):
    # PLANS[3] has one request: its per-node positions are a stride-0 view (a regression case)
    ref, fast = _engines(tiny_root, "eagle3", graphs=True, skinny=SKINNY_AROUND, speculative_token_tree=TREE,
                         capture_sizes=(1, 4), token_capture_sizes=(32,))
    _compare(ref, fast, PLANS[:4])
