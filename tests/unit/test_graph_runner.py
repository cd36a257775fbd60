"""The graph runner's per-call contract: drafts in a fresh tensor of the real batch (stored by the
loop graph's last kernel, padded rows never), one combined replay for decode calls giving the
two-graph path's and the eager path's drafts, and a header never rewritten before the last
replay that reads it.

Without a GPU the runner emulates graphs (capture keeps the function, replay calls it) and the
kernels run under the Triton interpreter with every access bounds-checked; with one, real graphs.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")

from drafter.engine.config import EngineConfig  # noqa: E402
from drafter.engine.graphs import GraphRunner, decode_size_pairs  # noqa: E402
from tests.support.engines import build_engine  # noqa: E402
from tests.support.scenario import Scenario  # noqa: E402
from tests.support.triton_bounds import allowing, allowing_outputs  # noqa: E402
from tests.support.triton_bounds import bounds_checked  # noqa: E402,F401 - an autouse fixture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_MODEL_LEN = 48
K = 3
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
# what is checked here is the graphs' data flow, not the weight GEMMs: on CPU the interpreted skinny
# kernel was ~60% of this file's time; tests/unit/test_triton_kernels.py and test_step_kernels.py
# check it (in an engine, and alone with every epilogue)
SKINNY = "on" if DEVICE == "cuda" else "off"


def _engine(root, *, reference=False, **config):
    kw = dict(k=K, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=32, skinny_gemm=SKINNY)
    kw.update(config)
    if reference:
        return build_engine(root, "eagle3", **kw)
    engine = build_engine(root, "eagle3", attention_backend="triton", device=DEVICE, **kw)
    if DEVICE == "cpu":
        engine.graphs = GraphRunner(engine, emulate=True)
    return engine


def _scenario(engine, seed=3):
    return Scenario(block_sizes=engine.limits.block_sizes, num_blocks=engine.limits.num_blocks,
                    vocab_size=engine.spec.vocab_size, hidden_width=engine.spec.hidden_input_width, k=K,
                    max_model_len=MAX_MODEL_LEN, seed=seed, draft_span=engine.limits.draft_span)


def _on_device(kwargs):
    return {k: ([t.to(DEVICE) for t in v] if isinstance(v, list) else v.to(DEVICE)) for k, v in kwargs.items()}


def _propose(engine, kwargs, **extra):
    kwargs = _on_device(kwargs)
    tensors = [t for v in kwargs.values() for t in (v if isinstance(v, list) else [v])]
    with allowing(tensors), allowing_outputs(engine.graphs):
        return engine.propose(**kwargs, **extra)


def _decode(width):
    """A prefill of two requests (21 tokens: no decode size), then decode steps of width + 1
    tokens each (what the padded drafter batch sends) at batch 3 (padded to 4) and 2, with
    rejections; request 2 joins at the first decode step."""
    q = width + 1
    return [[(0, 9, 0), (1, 12, 0)], [(0, q, 1), (1, q, 0), (2, q, 2)], [(0, q, 0), (2, q, 1)],
            [(0, q, 2), (1, q, 1), (2, q, 0)]]


# ---------------------------------------------------------------------- the output tensor
def test_drafts_land_in_a_fresh_tensor_of_the_real_batch(tiny_root):
    """Batch 3 padded to 4: [3, k] drafts equal to the eager engine's, each call a new tensor
    that owns its memory, and an earlier call's drafts survive a later call."""
    ref = _engine(tiny_root, reference=True, capture_sizes=(4,), token_capture_sizes=(16, 32))
    fast = _engine(tiny_root, capture_sizes=(4,), token_capture_sizes=(16, 32))
    s_ref, s_fast = _scenario(ref), _scenario(fast)
    kept = []
    for plan in _decode(K):
        expected = ref.propose(**s_ref.call(plan).kwargs).draft_token_ids
        out = _propose(fast, s_fast.call(plan).kwargs)
        ids = out.draft_token_ids
        assert ids.shape == (len(plan), K) and ids.dtype == torch.int64
        assert ids._base is None and ids.is_contiguous(), "a tensor of its own, not a view of a static buffer"
        assert out.batch_padded == 4
        assert torch.equal(ids.cpu(), expected)
        kept.append((ids, expected))
    assert len({ids.data_ptr() for ids, _ in kept}) == len(kept), "every call gets its own memory"
    for ids, expected in kept:
        assert torch.equal(ids.cpu(), expected), "a later call overwrote an earlier call's drafts"
    assert fast.graphs.replays == len(kept)
    assert fast.graph_replays == len(kept), "what the service's graph-replay metric reads"


def test_store_drafts_writes_only_the_real_rows():
    """The loop graph's last kernel: rows [0, batch) of the drafts into the header's output;
    the rest of a (deliberately larger) output keeps its sentinel.  Then it marks the header
    read (word DONE), also for the capture-time header, which stores nothing."""
    from drafter.kernels.batch_inputs import DONE, HEADER_WORDS, B, OUT
    from drafter.kernels.draft_output import store_drafts

    drafts = torch.arange(4 * 5, dtype=torch.int64, device=DEVICE).view(4, 5)  # [batch_padded 4, width 5]
    out = torch.full((4, 5), -7, dtype=torch.int64, device=DEVICE)
    header = torch.zeros(int(HEADER_WORDS), dtype=torch.int64, device=DEVICE)
    header[int(B)], header[int(OUT)] = 2, out.data_ptr()
    with allowing([out]):
        store_drafts(header, drafts)
    assert torch.equal(out[:2].cpu(), drafts[:2].cpu())
    assert bool((out[2:] == -7).all()), "padded rows must not be stored"
    assert int(header[int(DONE)]) == 1, "the header must be marked read"
    header.zero_()  # the capture-time header: nothing stored, nothing read but the header
    store_drafts(header, drafts)
    assert int(header[int(DONE)]) == 1
    many = torch.arange(150 * 3, dtype=torch.int64, device=DEVICE).view(150, 3)  # rows in three blocks of 64
    out = torch.full((150, 3), -7, dtype=torch.int64, device=DEVICE)
    header[int(B)], header[int(OUT)] = 130, out.data_ptr()
    with allowing([out]):
        store_drafts(header, many)
    assert torch.equal(out[:130].cpu(), many[:130].cpu()) and bool((out[130:] == -7).all())


# ---------------------------------------------------------------------- one replay per decode call
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_combined_graph_matches_two_graphs_and_eager(tiny_root, shape):
    """Decode calls replay the combined graph, the prefill the two graphs.  Each call runs twice
    on the same engine, once per path (a call is idempotent: the same KV rows get the same
    values), and both give the eager reference engine's drafts."""
    tree = dict(speculative_token_tree=TREE) if shape == "tree" else {}
    width = len(TREE) if tree else K
    sizes = dict(capture_sizes=(2, 4), token_capture_sizes=(8, 16, 32), **tree)
    ref, fast = _engine(tiny_root, reference=True, **sizes), _engine(tiny_root, **sizes)
    s_ref, s_fast = _scenario(ref), _scenario(fast)
    runner = fast.graphs
    runner.capture()
    combined = runner.combined_graphs
    plans = _decode(width)
    for plan in plans:
        expected = ref.propose(**s_ref.call(plan).kwargs).draft_token_ids
        call = s_fast.call(plan).kwargs
        got_combined = _propose(fast, call).draft_token_ids
        runner.combined_graphs = {}  # the two-graph path for the same call
        got_split = _propose(fast, call).draft_token_ids
        runner.combined_graphs = combined
        assert torch.equal(got_combined.cpu(), expected), f"{shape} plan {plan}: combined"
        assert torch.equal(got_split.cpu(), expected), f"{shape} plan {plan}: two graphs"
    assert runner.combined_replays == len(plans) - 1, "every decode call is one replay"
    assert runner.replays == 2 * len(plans)
    for a, b in zip(ref.kv_snapshot(), fast.kv_snapshot()):
        torch.testing.assert_close(b.cpu(), a, atol=1e-4, rtol=1e-4)


def test_combined_graphs_can_be_turned_off(tiny_root):
    on = _engine(tiny_root, capture_sizes=(2, 4))
    off = _engine(tiny_root, capture_sizes=(2, 4), combined_graphs=False)
    assert on.graphs.combined_sizes and not off.graphs.combined_sizes
    with pytest.raises(ValueError, match="combined_graphs"):
        EngineConfig(method="eagle", combined_graphs="no")


def test_decode_size_pairs_follow_the_padded_decode_call():
    """(tokens_padded, batch_padded) of b requests of k + 1 tokens, for every b: one pair per
    batch size when k + 1 is a power of two, two where padding splits a batch size's range."""
    cfg = EngineConfig(method="eagle", num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=32)
    assert decode_size_pairs(cfg, 3, list(cfg.token_capture_sizes), list(cfg.capture_sizes)) == [
        (4, 1), (8, 2), (16, 4), (32, 8)]
    cfg = EngineConfig(method="eagle", num_speculative_tokens=2, max_num_seqs=8, max_num_batched_tokens=32)
    # k + 1 = 3: b = 3 -> 9 tokens (16), b = 4 -> 12 (16); b = 5 -> 15 (16), b = 6..8 -> 18..24 (32)
    assert decode_size_pairs(cfg, 2, list(cfg.token_capture_sizes), list(cfg.capture_sizes)) == [
        (4, 1), (8, 2), (16, 4), (16, 8), (32, 8)]
    # only pairs whose two sizes are both captured
    assert decode_size_pairs(cfg, 2, [4, 8], [1, 2, 4, 8]) == [(4, 1), (8, 2)]


# ---------------------------------------------------------------------- header rewrite safety
def test_header_is_rewritten_only_after_the_last_replay_read_it(tiny_root):
    """The first pass reads the header but leaves word DONE unset; the loop's last kernel sets
    it.  The next call rewrites the words at once when it is set, and when the caller queued
    that call before the previous one was done (DONE still 0), only after waiting, with the
    words the graphs read still in place."""
    from drafter.kernels.batch_inputs import DONE

    engine = _engine(tiny_root, max_num_seqs=2, max_num_batched_tokens=16, token_capture_sizes=(8,))
    runner = engine.graphs
    runner.capture()
    header = runner.header
    header.device, header.mapped = header.host, True  # as on a GPU: the kernels read and mark the host words
    log: list = []
    words_read: list[torch.Tensor] = []

    def logged(name, replay):
        def run():
            words_read[:] = [header.host[:int(DONE)].clone()]
            replay()
            if DEVICE == "cuda":
                torch.cuda.synchronize()  # a real replay is asynchronous: read the word once it has run
            log.append((name, int(header.host_words[DONE])))
        return run

    runner.first_graphs = {t: logged("first", g) for t, g in runner.first_graphs.items()}
    runner.loop_graphs = {b: logged("loop", g) for b, g in runner.loop_graphs.items()}
    runner.combined_graphs = {k: logged("combined", g) for k, g in runner.combined_graphs.items()}

    def device_finishing():  # stands in for the GPU finishing the previous call
        assert torch.equal(header.host[:int(DONE)], words_read[0]), "header rewritten before the graphs were done"
        log.append("wait")
        header.host_words[DONE] = 1

    header._wait_for_done = device_finishing
    scn = _scenario(engine)
    plans = ([(0, 5, 0), (1, 7, 0)], [(0, 4, 1), (1, 4, 0)], [(0, 4, 0), (1, 4, 2)])  # 12 tokens, then 8
    _propose(engine, scn.call(plans[0]).kwargs)
    _propose(engine, scn.call(plans[1]).kwargs)
    header.host_words[DONE] = 0  # as if the second call were still running
    _propose(engine, scn.call(plans[2]).kwargs)
    assert log == [("first", 0), ("loop", 1),  # the prefill: two graphs, the second marks the header
                   ("combined", 1),  # a decode call: one graph
                   "wait", ("combined", 1)]


# ---------------------------------------------------------------------- trusted in-process callers
def test_trusted_call_skips_validation_and_drafts_the_same(tiny_root, monkeypatch):
    """propose(validate=False) never runs the host-side checks (no device sync for GPU inputs)
    and gives the validated call's drafts and KV (on the reference engine: the flag only
    decides whether drafter.engine.inputs.validate runs, before any path is chosen)."""
    import drafter.engine.engine

    checked, trusted = _engine(tiny_root, reference=True), _engine(tiny_root, reference=True)
    s_checked, s_trusted = _scenario(checked), _scenario(trusted)
    real_check = drafter.engine.engine.check_inputs
    for i, plan in enumerate(_decode(K)):
        temps = dict(temperatures=[0.0] * len(plan)) if i == 2 else {}
        expected = checked.propose(**s_checked.call(plan, **temps).kwargs).draft_token_ids
        monkeypatch.setattr(drafter.engine.engine, "check_inputs", _must_not_run)
        got = trusted.propose(**s_trusted.call(plan, **temps).kwargs, validate=False).draft_token_ids
        monkeypatch.setattr(drafter.engine.engine, "check_inputs", real_check)
        assert torch.equal(got, expected), f"plan {plan}"
    for a, b in zip(checked.kv_snapshot(), trusted.kv_snapshot()):
        assert torch.equal(a, b)


def _must_not_run(*args):
    raise AssertionError("validate=False must not validate")
