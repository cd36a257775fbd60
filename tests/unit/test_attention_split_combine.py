"""Split-K ("flash-decoding") attention whose splits are combined inside the attention kernel.

Each split program stores its partials and arrives on a per-(q-block, kv head) counter; the
last to arrive combines all splits, writes the output and puts the counter back to 0.  These
tests force several split counts (TritonBackend(num_splits=...), with 16-key tiles so that
small caches give many tiles) and compare with the reference backend, then check the counters:
zero after every call, so a second call on the same backend (or a graph replay) is right.

Without a GPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set here
before any kernel is defined), one program after another, so the last-arriving program is
always split NUM_SPLITS - 1 and the combine path runs deterministically.  With a GPU the same
tests run on it, plus a CUDA-graph test and a repeated-launch stress test.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")

from drafter.attention import triton_backend  # noqa: E402
from drafter.attention.metadata import AttentionMetadata  # noqa: E402
from drafter.attention.reference import ReferenceBackend  # noqa: E402
from drafter.attention.triton_backend import TritonBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILE = 16  # keys per tile in these tests: a 128-key table row is 8 tiles


@pytest.fixture(autouse=True)
def bounds_checked():
    """Under the interpreter, every kernel access must stay inside its tensor arguments."""
    if DEVICE != "cpu":
        yield
        return
    from tests.support.triton_bounds import checking

    with checking():
        yield


def _batch(qlens, seq_lens, *, heads=4, kv_heads=2, head_dim=16, block_size=8, max_blocks=16, extra_rows=3,
           seed=0, dtype=torch.float32):
    """Random q and a random paged cache (already holding every key) on DEVICE, and metadata for
    requests with these query and sequence lengths; `extra_rows` padding rows after the last
    request belong to none."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = len(qlens) * max_blocks + 2
    n = sum(qlens) + extra_rows
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    table = torch.randperm(num_blocks, generator=g)[: len(qlens) * max_blocks].view(len(qlens), max_blocks).int()
    meta = AttentionMetadata(qsl.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                             table.to(DEVICE), torch.full((n,), -1, dtype=torch.long, device=DEVICE), block_size)
    q = torch.randn(n, heads, head_dim, generator=g).to(DEVICE, dtype)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    return q, cache, meta


def _reference(q, cache, meta, window):
    kv = q.new_zeros(q.shape[0], cache.shape[-2], q.shape[-1])  # slots are all -1: nothing is written
    return ReferenceBackend().forward(q, kv, kv, cache, meta, window)


def _splits_used(backend, q, meta):
    return backend._splits(q.device, 1, meta.block_table.shape[1] * meta.block_size)


def _grid(q, cache, meta):
    """(q-blocks, kv heads) of the attention launch: the counters a split launch needs."""
    n, num_heads = q.shape[0], q.shape[1]
    num_reqs = meta.query_start_loc.shape[0] - 1
    group_pad = triton.next_power_of_2(num_heads // cache.shape[-2])
    block_m = max(16, group_pad if n <= num_reqs else 8 * group_pad)
    return (n // max(1, block_m // group_pad) + num_reqs + 1) * cache.shape[-2]


def _check_counters(backend, device, grid):
    counters = backend.split_counters(torch.device(device), 0)  # size 0: never grows, just returns it
    assert counters.numel() >= grid
    assert int(counters.count_nonzero()) == 0, "a launch left a split counter set"


CASES = {
    # a prefill over several q-blocks and tiles, a decode row, a short query; 3 padding rows after
    "mixed": dict(qlens=[3, 1, 20], seq_lens=[10, 1, 100]),
    # one row per request (the decode-shaped launch), a padded request (seq_len 0) in the middle
    "decode": dict(qlens=[1, 1, 1, 1], seq_lens=[17, 0, 70, 128], extra_rows=0),
    # padded requests with no query rows at all, one request with a single key tile
    "empty-requests": dict(qlens=[0, 2, 0], seq_lens=[0, 5, 0]),
    # a group of 3 query heads per kv head (padded to 4 rows), several q-blocks
    "gqa3": dict(qlens=[9, 2], seq_lens=[60, 33], heads=6, kv_heads=2),
    # multi-head (group 1) and multi-query (group 4)
    "mha": dict(qlens=[2, 5], seq_lens=[9, 90], kv_heads=4),
    "mqa-block16": dict(qlens=[4, 1], seq_lens=[120, 3], kv_heads=1, block_size=16, max_blocks=8),
}


@pytest.mark.parametrize("splits", [2, 3, 8])  # 8 splits > the key tiles of most requests here
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("case", sorted(CASES))
def test_split_attention_matches_reference(case, window, splits):
    q, cache, meta = _batch(**CASES[case])
    expected = _reference(q, cache, meta, window)
    backend = TritonBackend(num_splits=splits, block_n=TILE)
    assert _splits_used(backend, q, meta) == splits  # the split path really runs
    out = backend.attend(q, cache, meta, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    _check_counters(backend, DEVICE, _grid(q, cache, meta))


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("case", ["mixed", "decode", "gqa3"])
def test_combine_without_unrolling(monkeypatch, case, window):
    """The combining program's loop, one split per step (no unrolling; the default unrolls
    several): the same result."""
    monkeypatch.setattr(triton_backend, "COMBINE_ELEMS", 1)
    q, cache, meta = _batch(**CASES[case], seed=5)
    expected = _reference(q, cache, meta, window)
    backend = TritonBackend(num_splits=8, block_n=TILE)
    out = backend.attend(q, cache, meta, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    _check_counters(backend, DEVICE, _grid(q, cache, meta))


@pytest.mark.parametrize("splits", [2, 4, 8])
def test_split_attention_default_tiles(splits):
    """64-key tiles (the production size) over a 256-key table: 4 tiles at most, so 8 splits
    become 4; the 64- and 130-key requests have fewer tiles than splits."""
    q, cache, meta = _batch([5, 1, 2], [250, 64, 130], block_size=16, max_blocks=16)
    for window in (None, 40):
        expected = _reference(q, cache, meta, window)
        backend = TritonBackend(num_splits=splits)
        assert _splits_used(backend, q, meta) == min(splits, 4)
        torch.testing.assert_close(backend.attend(q, cache, meta, window), expected, atol=1e-5, rtol=1e-5)
        _check_counters(backend, DEVICE, _grid(q, cache, meta))


@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("window", [None, 3, 30])
def test_split_tree_attention_matches_reference(splits, window):
    # 2 requests, 5 tree nodes at the end of their keys, this level's 2 nodes query: node 3
    # descends from node 0, node 4 from node 1; their positions are context end + depth
    mask = torch.tensor([[1, 0, 0, 1, 0], [0, 1, 0, 0, 1]], dtype=torch.bool, device=DEVICE)
    depths = torch.tensor([1, 1, 1, 2, 2], device=DEVICE)
    q, cache, meta = _batch([2, 2], [40, 101], extra_rows=1)
    meta.tree_mask, meta.tree_depths = mask, depths
    expected = _reference(q, cache, meta, window)
    backend = TritonBackend(num_splits=splits, block_n=TILE)
    assert _splits_used(backend, q, meta) == splits
    torch.testing.assert_close(backend.attend(q, cache, meta, window), expected, atol=1e-5, rtol=1e-5)
    _check_counters(backend, DEVICE, _grid(q, cache, meta))


def test_second_call_on_the_same_backend_is_right():
    """The counters are reset by the launch that used them: a second launch with other inputs
    (same shapes, as a graph replay; then other shapes) still combines correctly."""
    backend = TritonBackend(num_splits=4, block_n=TILE)
    first = _batch(**CASES["mixed"], seed=1)
    second = _batch(**CASES["mixed"], seed=2)
    other = _batch(**CASES["decode"], seed=3)
    out1 = backend.attend(*first, None)
    torch.testing.assert_close(out1, _reference(*first, None), atol=1e-5, rtol=1e-5)
    out2 = backend.attend(*second, None)
    expected2 = _reference(*second, None)
    assert not torch.allclose(expected2, out1, atol=1e-3)  # the second answer is a new one
    torch.testing.assert_close(out2, expected2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(backend.attend(*other, 7), _reference(*other, 7), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(backend.attend(*first, None), out1, atol=1e-6, rtol=1e-6)
    _check_counters(backend, DEVICE, _grid(*first))


def test_counters_are_zeroed_when_made_and_after_every_call():
    backend = TritonBackend(num_splits=1, block_n=TILE)
    q, cache, meta = _batch(**CASES["mixed"])
    backend.attend(q, cache, meta, None)
    assert backend._counters == {}  # one split: no counters needed, none made
    backend.num_splits = 8
    backend.attend(q, cache, meta, None)
    _check_counters(backend, DEVICE, _grid(q, cache, meta))


def test_counters_grow_outside_capture_only(monkeypatch):
    backend = TritonBackend(num_splits=4, block_n=TILE)
    dev = torch.device(DEVICE)
    small = backend.split_counters(dev, 10)
    assert small.dtype == torch.int32 and small.numel() >= 10 and int(small.count_nonzero()) == 0
    assert backend.split_counters(dev, small.numel()) is small  # big enough: the same buffer
    big = backend.split_counters(dev, small.numel() + 1)
    assert big.numel() > small.numel() and int(big.count_nonzero()) == 0
    assert any(t is small for t in backend._retired_counters)  # graphs captured with it keep working
    # during a capture a buffer that is big enough is returned, growing raises
    monkeypatch.setattr(triton_backend, "_capturing", lambda device: True)
    assert backend.split_counters(dev, big.numel()) is big
    with pytest.raises(RuntimeError, match="capture"):
        backend.split_counters(dev, big.numel() + 1)
    with pytest.raises(RuntimeError, match="capture"):
        TritonBackend(num_splits=4, block_n=TILE).attend(*_batch(**CASES["mixed"]), None)


def test_dirty_counter_is_detected():
    """The tests above can fail: with counters left set, no program sees NUM_SPLITS - 1 and
    no block's rows are written."""
    backend = TritonBackend(num_splits=4, block_n=TILE)
    q, cache, meta = _batch(**CASES["decode"], seed=4)
    expected = _reference(q, cache, meta, None)
    counters = backend.split_counters(torch.device(DEVICE), _grid(q, cache, meta))
    counters.fill_(1000)  # as if earlier launches had not reset them
    out = backend.attend(q, cache, meta, None)
    assert not torch.allclose(out, expected, atol=1e-3)
    counters.zero_()
    torch.testing.assert_close(backend.attend(q, cache, meta, None), expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- GPU only
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_attention_in_a_cuda_graph(dtype):
    """Warm-up eagerly (makes the counters), capture, replay with new values many times: every
    replay equals the reference and leaves the counters at zero.  A capture that would need to
    grow the counters raises (and the capture itself still ends cleanly)."""
    backend = TritonBackend(num_splits=16)
    q, cache, meta = _batch([1] * 6, [1, 700, 2048, 0, 65, 1500], heads=32, kv_heads=8, head_dim=128,
                            block_size=16, max_blocks=129, extra_rows=2, dtype=dtype)
    backend.attend(q, cache, meta, None)  # the warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend(q, cache, meta, None)
        with pytest.raises(RuntimeError, match="capture"):
            backend.split_counters(q.device, 1 << 30)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for seed in range(5):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q.copy_(torch.randn(q.shape, device="cuda", generator=g))
        cache.copy_(torch.randn(cache.shape, device="cuda", generator=g))
        graph.replay()
        torch.cuda.synchronize()
        expected = _reference(q, cache, meta, None)
        err = float((out.float() - expected.float()).norm() / expected.float().norm())
        assert err < tol, f"replay {seed}: relative error {err}"
        _check_counters(backend, "cuda", _grid(q, cache, meta))


@gpu
def test_split_attention_repeated_launches_are_stable():
    """Many back-to-back launches with 64 splits (most programs racing to arrive) give the
    one-split result every time: a lost ordering would show as a wrong row now and then."""
    q, cache, meta = _batch([1] * 4 + [7], [4000, 33, 2500, 4096, 3000], heads=32, kv_heads=8, head_dim=128,
                            block_size=16, max_blocks=257, extra_rows=3)
    want = TritonBackend(num_splits=1).attend(q, cache, meta, None)
    backend = TritonBackend(num_splits=64)
    outs = [backend.attend(q, cache, meta, None) for _ in range(200)]
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"launch {i}: {m}")
    _check_counters(backend, "cuda", _grid(q, cache, meta))
