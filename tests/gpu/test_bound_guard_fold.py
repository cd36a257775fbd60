"""On a GPU: the step guard folded into a binding's CUDA graphs (drafter.engine.bound.BoundPropose.fold)
against the guard as it ran before the fold (its own captured graph, its sizes filled per step, then
the bound call's replay).

Run on a GPU host:  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_bound_guard_fold.py
Elsewhere every test here is skipped (tests/unit/test_bound_fold.py checks the same data flow on CPU
with emulated graphs; tests/gpu/test_bound_ipc.py the service's folded sessions over CUDA IPC).

One engine (the engine's own capture sizes: every combined decode pair folded), two bindings over
their own target buffers, both in the same session range of the pool: the folded one and the
unfolded one take the same steps, clean and corrupt, and must give the same drafts, the same error
word and the same masked buffers, bit for bit; no step writes KV outside the session's blocks; a
decode step of the folded binding is one replay of a folded graph.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU host"),
]

from drafter.engine.graphs import GraphRunner  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from tests.support.engines import build_engine  # noqa: E402
from tests.unit.test_bound_fold import (CORRUPT, DECODE, K, MAX_BATCH, MAX_MODEL_LEN, MAX_TOKENS, PAIR,  # noqa: E402
                                        PREFILL, Q, SESSION, Guarded, _fill, _other_session, _scenario)

TWO = [(0, Q, 0), (1, Q, 2)]  # a 2-request decode step: the folded (8, 2) graph
MORE_CORRUPT = [
    ("target_token_ids", lambda s: s["target_token_ids"].__setitem__(0, -1)),
    ("next_token_ids", lambda s: s["next_token_ids"].__setitem__(2, 1 << 40)),
    ("query_start_loc", lambda s: s["query_start_loc"].__setitem__(2, int(s["query_start_loc"][1]))),
    ("seq_lens", lambda s: s["seq_lens"].__setitem__(1, MAX_MODEL_LEN + 1)),
    ("token_indices_to_sample", lambda s: s["token_indices_to_sample"].__setitem__(0, 16)),
    ("num_rejected_tokens", lambda s: s["num_rejected_tokens"].__setitem__(3, K + 1)),
]


@pytest.fixture(scope="module")
def engines(tiny_root):
    """The in-process reference, the guarded engine (CUDA graphs at its own sizes), a folded binding
    and one with the guard's own captured graph replayed before each bound call (the unfolded path)."""
    kw = dict(k=K, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_TOKENS)
    ref = build_engine(tiny_root, "eagle3", num_blocks=SESSION, **kw)
    engine = build_engine(tiny_root, "eagle3", attention_backend="triton", device="cuda", num_blocks=2 * SESSION,
                          skinny_gemm="on", **kw)
    if engine.graphs is None:
        engine.graphs = GraphRunner(engine)
    engine.graphs.capture()
    folded, alone = Guarded(engine, fold=True), Guarded(engine, fold=False)
    alone.guard.capture()  # as the service ran it before the fold: its own graph, its sizes filled per step
    assert folded.bound._folded, "no combined decode graph was folded"
    return ref, engine, folded, alone


def _same_outputs(a: Guarded, b: Guarded) -> None:
    for name, t in a.guard.out.items():
        assert torch.equal(t, b.guard.out[name]), name


def test_clean_steps_fold_to_one_replay_and_draft_as_unfolded(engines):
    ref, engine, folded, alone = engines
    runner = engine.graphs
    s_ref, s_folded, s_alone = _scenario(ref), _scenario(ref), _scenario(ref)
    for plan in (PREFILL, DECODE, TWO, PAIR, DECODE, TWO):
        expected = ref.propose(**s_ref.call(plan).kwargs).draft_token_ids
        n, b = _fill(folded.src, s_folded.call(plan).kwargs)
        before = (runner.replays, runner.folded_replays)
        drafts, word = folded.step(n, b)
        decode = plan in (DECODE, TWO)
        assert runner.folded_replays - before[1] == int(decode), plan
        assert runner.replays - before[0] == 1, plan
        assert torch.equal(drafts, expected) and word == 0, plan
        drafts_alone, word_alone = alone.step(*_fill(alone.src, s_alone.call(plan).kwargs))
        assert torch.equal(drafts_alone, drafts) and word_alone == 0, plan
        _same_outputs(folded, alone)


@pytest.mark.parametrize("field,corrupt", CORRUPT + MORE_CORRUPT)
def test_corrupt_steps_are_named_and_masked_as_unfolded(engines, field, corrupt):
    ref, engine, folded, alone = engines
    outside = _other_session(engine)
    results = []
    for g in (folded, alone):
        s = _scenario(ref)
        g.step(*_fill(g.src, s.call(PREFILL).kwargs))
        n, b = _fill(g.src, s.call(DECODE).kwargs)
        corrupt(g.src)
        results.append((*g.step(n, b), {name: t.clone() for name, t in g.guard.out.items()}))
        assert g.step(*_fill(g.src, s.call(DECODE).kwargs))[1] == 0, "the word is rewritten every step"
    assert wb.first_bad_guard_field(results[0][1], 1) == field
    assert results[0][1] == results[1][1]
    assert torch.equal(results[0][0], results[1][0])
    for name, t in results[0][2].items():  # the masked buffers the engine read, bit for bit
        assert torch.equal(t, results[1][2][name]), name
    assert all(torch.equal(a, b) for a, b in zip(outside, _other_session(engine))), \
        "a corrupt step wrote another session's KV"
