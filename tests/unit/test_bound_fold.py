"""A step guard folded into a binding's graphs (drafter.engine.bound.BoundPropose.fold): the guard's
sizes come from the header the bound call stores, a decode step is one (folded) replay, and the
drafts and error words are those of the guard run on its own before an unguarded bound call.

Without a GPU the graph runner emulates graphs (a "replay" runs the captured function again) and
the kernels run under the Triton interpreter: the same data flow as on a GPU, where
tests/gpu/test_bound_guard_fold.py checks the captured graphs.  One runner is captured for the
sizes these steps use only (an emulated capture runs every graph once: seconds each).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")

from drafter.engine.graphs import GraphRunner  # noqa: E402
from drafter.engine.step_guard import GuardLimits, StepGuard  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from tests.support.engines import build_engine  # noqa: E402
from tests.support.scenario import Scenario  # noqa: E402
from tests.support.triton_bounds import allowing  # noqa: E402
from tests.support.triton_bounds import bounds_checked  # noqa: E402,F401 - an autouse fixture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K, MAX_MODEL_LEN, MAX_TOKENS, MAX_BATCH = 3, 48, 32, 4
SESSION = 16  # the session's KV blocks; the guarded engine's pool has two sessions, this one second
Q = K + 1
DECODE = [(0, Q, 1), (1, Q, 0), (2, Q, 2), (3, Q, 0)]  # 16 tokens, 4 requests: the folded (16, 4) graph
PREFILL = [(0, 9, 0), (1, 12, 0), (2, 5, 0), (3, 3, 0)]  # 29 tokens, 4 requests: the guard's own graph, then (32, 4)
PAIR = [(0, 9, 0), (1, 12, 0)]  # 2 requests: no graph, the eager path (the guard run alone first)


def _engine(root, *, reference: bool):
    kw = dict(k=K, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_TOKENS,
              skinny_gemm="on" if DEVICE == "cuda" else "off")
    if reference:
        return build_engine(root, "eagle3", num_blocks=SESSION, **kw)
    engine = build_engine(root, "eagle3", attention_backend="triton", device=DEVICE, num_blocks=2 * SESSION, **kw)
    engine.graphs = runner = GraphRunner(engine, emulate=DEVICE == "cpu")
    runner.token_sizes, runner.batch_sizes, runner.combined_sizes = [16, 32], [MAX_BATCH], [(16, MAX_BATCH)]
    runner.capture()
    return engine


def _src(engine) -> dict[str, torch.Tensor]:
    """The target's buffers, as a slab's views hold them (the guard's input)."""
    d, blocks = DEVICE, engine.config.max_blocks_per_req[0]
    return {"target_token_ids": torch.zeros(MAX_TOKENS, dtype=torch.int64, device=d),
            "target_positions": torch.zeros(MAX_TOKENS, dtype=torch.int64, device=d),
            wb.HIDDEN: torch.zeros(MAX_TOKENS, engine.spec.hidden_input_width, device=d),
            "next_token_ids": torch.zeros(MAX_BATCH, dtype=torch.int64, device=d),
            "query_start_loc": torch.zeros(MAX_BATCH + 1, dtype=torch.int32, device=d),
            "seq_lens": torch.zeros(MAX_BATCH, dtype=torch.int32, device=d),
            "token_indices_to_sample": torch.zeros(MAX_BATCH, dtype=torch.int32, device=d),
            "num_rejected_tokens": torch.zeros(MAX_BATCH, dtype=torch.int32, device=d),
            "block_tables[0]": torch.zeros(MAX_BATCH, blocks, dtype=torch.int32, device=d),
            "slot_mappings[0]": torch.zeros(MAX_TOKENS, dtype=torch.int64, device=d)}


def _fill(src: dict, call: dict) -> tuple[int, int]:
    call = dict(call)
    b = call["next_token_ids"].shape[0]
    call.setdefault("num_rejected_tokens", torch.zeros(b, dtype=torch.int32))
    call.setdefault("token_indices_to_sample", call["query_start_loc"][1:] - 1 - call["num_rejected_tokens"])
    for name, value in call.items():
        for dst, v in ([(src[f"{name}[{g}]"], x) for g, x in enumerate(value)] if isinstance(value, list)
                       else [(src[name], value)]):
            rows = tuple(slice(0, min(a, c)) for a, c in zip(v.shape, dst.shape))
            dst[rows].copy_(v[rows].to(dst.device))
    return call["target_token_ids"].shape[0], b


class Guarded:
    """One binding behind a step guard over its own target buffers; folded or the guard run alone."""

    def __init__(self, engine, fold: bool):
        self.src = _src(engine)
        self.error = torch.full((1,), -7, dtype=torch.int64, device=DEVICE)
        limits = GuardLimits(vocab_size=engine.spec.vocab_size, max_model_len=MAX_MODEL_LEN,
                             num_speculative_tokens=K, num_blocks=(SESSION,),
                             block_sizes=tuple(engine.limits.block_sizes), bases=(SESSION,))
        self.guard = StepGuard(self.src, limits, self.error)
        o = self.guard.out
        self.bound = engine.bind(
            target_token_ids=o["target_token_ids"], target_positions=o["target_positions"],
            target_hidden_states=self.src[wb.HIDDEN], next_token_ids=o["next_token_ids"],
            query_start_loc=o["query_start_loc"], seq_lens=o["seq_lens"], block_tables=[o["block_tables[0]"]],
            slot_mappings=[o["slot_mappings[0]"]], token_indices_to_sample=o["token_indices_to_sample"],
            num_rejected_tokens=o["num_rejected_tokens"])
        self.fold = fold
        if fold:
            self.bound.fold(self.guard)

    def step(self, n: int, b: int) -> tuple[torch.Tensor, int]:
        tensors = [*self.src.values(), *self.guard.out.values(), self.bound.drafts]
        with allowing(tensors):
            if not self.fold:
                self.guard.step(n, b)
            drafts = self.bound.propose(n, b)[:b].cpu()
        return drafts, int(self.error.item())


@pytest.fixture(scope="module")
def engines(tiny_root):
    """The in-process reference, and the guarded engine with one folded and one unfolded binding."""
    ref, engine = _engine(tiny_root, reference=True), _engine(tiny_root, reference=False)
    return ref, engine, Guarded(engine, fold=True), Guarded(engine, fold=False)


def _scenario(engine) -> Scenario:
    return Scenario(block_sizes=engine.limits.block_sizes, num_blocks=[SESSION], vocab_size=engine.spec.vocab_size,
                    hidden_width=engine.spec.hidden_input_width, k=K, max_model_len=MAX_MODEL_LEN, seed=5,
                    draft_span=engine.limits.draft_span)


def _other_session(engine) -> list[torch.Tensor]:
    """The KV of the pool's first SESSION blocks (another session's): the bindings' lie past them."""
    return [t[:, :SESSION] if t.dim() == 5 else t[:SESSION] for t in engine.kv_snapshot()]


def test_folded_guard_drafts_as_the_guard_alone_and_in_process(engines):
    """Clean steps over every path a folded binding takes (the folded decode graph, the guard's own
    graph before the first-pass and loop graphs, the eager path): the drafts are the in-process
    engine's (the guard moved every block into the session's range: the same KV, elsewhere), the
    word 0; the same steps through the unfolded binding give the same drafts."""
    ref, engine, folded, alone = engines
    runner = engine.graphs
    assert folded.error.item() == 0, "capture ran the guard over a cleared header: no live row, word 0"
    s_ref, s_folded, s_alone = _scenario(ref), _scenario(ref), _scenario(ref)
    for plan, path in ((PREFILL, "alone"), (DECODE, "folded"), (PAIR, "eager"), (DECODE, "folded")):
        expected = ref.propose(**s_ref.call(plan).kwargs).draft_token_ids
        before = (runner.replays, runner.folded_replays)
        drafts, word = folded.step(*_fill(folded.src, s_folded.call(plan).kwargs))
        counted = (runner.replays - before[0], runner.folded_replays - before[1])
        assert counted == {"alone": (1, 0), "folded": (1, 1), "eager": (0, 0)}[path], plan
        assert torch.equal(drafts, expected) and word == 0, plan
        drafts_alone, word_alone = alone.step(*_fill(alone.src, s_alone.call(plan).kwargs))
        assert torch.equal(drafts_alone, drafts) and word_alone == 0, plan


CORRUPT = [("slot_mappings[0]", lambda s: s["slot_mappings[0]"].__setitem__(2, -5)),
           ("block_tables[0]", lambda s: s["block_tables[0]"].__setitem__((1, 0), SESSION)),
           (wb.HIDDEN, lambda s: s[wb.HIDDEN].__setitem__((3, 1), float("nan"))),
           ("target_positions", lambda s: s["target_positions"].__setitem__(5, MAX_MODEL_LEN))]


@pytest.mark.parametrize("field,corrupt", [CORRUPT[0], CORRUPT[2]])  # the KV writes' two guards (GPU: all)
def test_a_corrupt_folded_step_is_named_as_alone_and_writes_only_its_session(engines, field, corrupt):
    """The same corrupt decode step through the folded graph and through the guard alone: the
    same word naming that field alone, the same drafts, no KV written outside the session's blocks."""
    ref, engine, folded, alone = engines
    outside = _other_session(engine)
    results = []
    for g in (folded, alone):
        s = _scenario(ref)
        g.step(*_fill(g.src, s.call(PREFILL).kwargs))
        n, b = _fill(g.src, s.call(DECODE).kwargs)
        corrupt(g.src)
        results.append(g.step(n, b))
    assert results[0][1] == 1 << wb.guard_fields(1).index(field)
    assert results[0][1] == results[1][1]
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outside, _other_session(engine))), \
        "a corrupt step wrote another session's KV"
