"""Bound calls (drafter.engine.bound): a trusted caller's persistent buffers described once, then each
step only its sizes.  They must draft what propose() drafts from the same rows (the buffers are
read in place, so a later step's values count), share the header with unbound calls, refuse
buffers the loader cannot read in place and sizes outside the buffers (naming the field), and
fall back to the eager path where no graph covers the call.

Without a GPU the graph runner emulates graphs and the kernels run under the Triton
interpreter, every access bounds-checked.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")

from drafter.engine.graphs import GraphRunner  # noqa: E402
from drafter.wire.errors import InvalidInput  # noqa: E402
from tests.support.engines import build_engine  # noqa: E402
from tests.support.scenario import Scenario  # noqa: E402
from tests.support.triton_bounds import allowing, allowing_outputs  # noqa: E402
from tests.support.triton_bounds import bounds_checked  # noqa: E402,F401 - an autouse fixture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_MODEL_LEN = 48
K = 3
MAX_TOKENS, MAX_BATCH = 32, 4
# the graphs _decode_plans' steps replay (prefill (32, 2) and (32, 4) by two graphs, decode (8, 2) and
# (16, 4) by one): what the default sizes pad every step to, without their batch-1 and 1-4-token graphs,
# which only cost captures under the interpreter; test_bound_call_sizes_are_checked... captures the defaults
STEP_SIZES = dict(capture_sizes=(2, MAX_BATCH), token_capture_sizes=(8, 16, MAX_TOKENS))


def _engine(root, *, reference=False, max_graph_batch=None, **config):
    # bound calls' data flow is checked here, not the weight GEMMs: on CPU the interpreted skinny
    # kernel only slowed it down (tests/unit/test_triton_kernels.py checks it in an engine)
    kw = dict(k=K, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_TOKENS,
              skinny_gemm="on" if DEVICE == "cuda" else "off")
    kw.update(config)
    if reference:
        return build_engine(root, "eagle3", **kw)
    engine = build_engine(root, "eagle3", attention_backend="triton", device=DEVICE, **kw)
    if DEVICE == "cpu" or max_graph_batch is not None:
        engine.graphs = GraphRunner(engine, max_batch=max_graph_batch, emulate=DEVICE == "cpu")
    return engine


def _scenario(engine, seed=3):
    return Scenario(block_sizes=engine.limits.block_sizes, num_blocks=engine.limits.num_blocks,
                    vocab_size=engine.spec.vocab_size, hidden_width=engine.spec.hidden_input_width, k=K,
                    max_model_len=MAX_MODEL_LEN, seed=seed, draft_span=engine.limits.draft_span)


class Buffers:
    """A target engine's persistent inputs: full-size, refilled in place every step."""

    def __init__(self, engine):
        d, width = DEVICE, engine.spec.hidden_input_width
        blocks = engine.config.max_blocks_per_req[0]
        self.kwargs = dict(
            target_token_ids=torch.zeros(MAX_TOKENS, dtype=torch.int64, device=d),
            target_positions=torch.zeros(MAX_TOKENS, dtype=torch.int64, device=d),
            target_hidden_states=torch.zeros(MAX_TOKENS, width, dtype=torch.float32, device=d),
            next_token_ids=torch.zeros(MAX_BATCH, dtype=torch.int64, device=d),
            query_start_loc=torch.zeros(MAX_BATCH + 1, dtype=torch.int32, device=d),
            seq_lens=torch.zeros(MAX_BATCH, dtype=torch.int32, device=d),
            block_tables=[torch.zeros(MAX_BATCH, blocks, dtype=torch.int32, device=d)],
            slot_mappings=[torch.zeros(MAX_TOKENS, dtype=torch.int64, device=d)],
            num_rejected_tokens=torch.zeros(MAX_BATCH, dtype=torch.int32, device=d),
            token_indices_to_sample=torch.zeros(MAX_BATCH, dtype=torch.int32, device=d),
        )

    def fill(self, call: dict) -> tuple[int, int]:
        """Copy a call's tensors into the buffers' first rows; (num_tokens, batch)."""
        call = dict(call)
        b = call["next_token_ids"].shape[0]
        call.setdefault("num_rejected_tokens", torch.zeros(b, dtype=torch.int32, device=DEVICE))
        # the buffers name sample rows on every step: where the call leaves them to the engine,
        # the last row of each request that was not rejected, as the engine derives them
        call.setdefault("token_indices_to_sample", call["query_start_loc"][1:] - 1 - call["num_rejected_tokens"])
        for name, value in call.items():
            for dst, src in (zip(self.kwargs[name], value) if isinstance(value, list) else [(self.kwargs[name], value)]):
                # a table may carry spare columns past max_model_len's blocks: the buffer has none
                rows = tuple(slice(0, min(a, b)) for a, b in zip(src.shape, dst.shape))
                dst[rows].copy_(src[rows])
        return call["target_token_ids"].shape[0], call["next_token_ids"].shape[0]

    def tensors(self):
        return [t for v in self.kwargs.values() for t in (v if isinstance(v, list) else [v])]


def _decode_plans():
    q = K + 1
    return [[(0, 9, 0), (1, 12, 0)], [(0, q, 1), (1, q, 0), (2, q, 2)], [(0, q, 0), (2, q, 1)],
            [(0, q, 2), (1, q, 1), (2, q, 0), (3, 7, 0)]]


def test_bound_calls_draft_what_propose_drafts(tiny_root):
    """Step by step against the reference engine: the buffers are re-filled in place, so the
    drafts can only match if every call reads the buffers' current values; one step in the
    middle goes through propose() on the same engine (the header is shared: a bound call after
    it must rewrite every word)."""
    ref = _engine(tiny_root, reference=True)
    fast = _engine(tiny_root, **STEP_SIZES)
    s_ref, s_fast = _scenario(ref), _scenario(fast)
    buffers = Buffers(fast)
    bound = fast.bind(**buffers.kwargs)
    assert bound.drafts.shape == (MAX_BATCH, K)
    for i, plan in enumerate(_decode_plans() + _decode_plans()[1:3]):
        expected = ref.propose(**s_ref.call(plan).kwargs).draft_token_ids
        call = {k: ([t.to(DEVICE) for t in v] if isinstance(v, list) else v.to(DEVICE))
                for k, v in s_fast.call(plan).kwargs.items()}
        with allowing(buffers.tensors() + [bound.drafts] + [t for v in call.values()
                                                            for t in (v if isinstance(v, list) else [v])]):
            if i == 2:
                with allowing_outputs(fast.graphs):
                    got = fast.propose(**call).draft_token_ids
            else:
                n, b = buffers.fill(call)
                drafts = bound.propose(n, b)
                assert drafts is bound.drafts, "the bound output buffer, not a new tensor"
                got = drafts[:b]
        assert torch.equal(got.cpu(), expected), f"step {i}: {plan}"
    assert fast.graphs.replays == 6


def test_bind_refuses_buffers_the_loader_cannot_read_in_place(tiny_root):
    engine = _engine(tiny_root)
    d = DEVICE
    cases = {
        "slot_mappings[0]": dict(slot_mappings=[torch.zeros(2 * MAX_TOKENS, dtype=torch.int64, device=d)[::2]]),
        "target_token_ids": dict(target_token_ids=torch.zeros(MAX_TOKENS, dtype=torch.float32, device=d)),
        "target_hidden_states": dict(target_hidden_states=torch.zeros(MAX_TOKENS, 3, device=d)),
        "block_tables[0]": dict(block_tables=[torch.zeros(MAX_BATCH, 1, dtype=torch.int32, device=d)]),
        "drafts": dict(drafts=torch.zeros(MAX_BATCH, K + 1, dtype=torch.int64, device=d)),
        "query_start_loc": dict(query_start_loc=torch.zeros(MAX_BATCH + 1, 2, dtype=torch.int32, device=d)),
    }
    hidden = torch.zeros(MAX_TOKENS, 2 * engine.spec.hidden_input_width, device=d)[:, ::2]
    cases["target_hidden_states "] = dict(target_hidden_states=hidden)  # right shape, strided rows: needs a copy
    if d == "cuda":  # pageable host memory: the GPU cannot read it in place
        cases["seq_lens"] = dict(seq_lens=torch.zeros(MAX_BATCH, dtype=torch.int32))
    for field, change in cases.items():
        with pytest.raises(InvalidInput) as err:
            engine.bind(**{**Buffers(engine).kwargs, **change})
        assert err.value.field == field.strip(), (field, str(err.value))


def test_bound_call_sizes_are_checked_and_a_bad_one_harms_nothing(tiny_root):
    ref = _engine(tiny_root, reference=True)
    fast = _engine(tiny_root)
    s_ref, s_fast = _scenario(ref), _scenario(fast)
    buffers = Buffers(fast)
    bound = fast.bind(**buffers.kwargs)
    kv_before = [t.clone() for t in fast.kv_snapshot()]
    for (n, b), field in 2 * list({(4, 0): "batch_size", (20, 5): "batch_size", (2, 3): "num_tokens",
                                   (33, 4): "num_tokens"}.items()):  # twice: a refusal is not remembered as a plan
        with pytest.raises(InvalidInput) as err:
            bound.propose(n, b)
        assert err.value.field == field
    for _ in range(2):  # agreed sizes too: a refusal is not remembered
        with pytest.raises(InvalidInput) as err:
            bound.propose(8, 2, batch_padded=64)
        assert err.value.field == "batch_padded"
    assert all(torch.equal(a, b) for a, b in zip(kv_before, fast.kv_snapshot())), "a refused call wrote KV"
    assert fast.graphs.replays == 0
    plan = _decode_plans()[0]
    expected = ref.propose(**s_ref.call(plan).kwargs).draft_token_ids
    call = {k: ([t.to(DEVICE) for t in v] if isinstance(v, list) else v.to(DEVICE))
            for k, v in s_fast.call(plan).kwargs.items()}
    n, b = buffers.fill(call)
    with allowing(buffers.tensors() + [bound.drafts]):
        assert torch.equal(bound.propose(n, b)[:b].cpu(), expected)
    with pytest.raises(InvalidInput) as err:  # the same sizes, now remembered, with a bad agreed size
        bound.propose(n, b, batch_padded=0)
    assert err.value.field == "batch_padded"


def test_buffers_larger_than_the_engine_still_get_the_engines_limits(tiny_root):
    engine = _engine(tiny_root, capture_sizes=(MAX_BATCH,), token_capture_sizes=(MAX_TOKENS,))  # bind captures them
    big = {name: (torch.cat([t, t[:2]]) if name in ("next_token_ids", "query_start_loc", "seq_lens",
                                                   "num_rejected_tokens", "token_indices_to_sample") else t)
           for name, t in Buffers(engine).kwargs.items()}
    big["block_tables"] = [torch.cat([t, t[:2]]) for t in big["block_tables"]]
    bound = engine.bind(**big, drafts=torch.zeros(MAX_BATCH + 2, K, dtype=torch.int64, device=DEVICE))
    assert bound.max_batch == MAX_BATCH + 2
    with pytest.raises(InvalidInput) as err:
        bound.propose(12, MAX_BATCH + 1)
    assert err.value.field == "batch_size" and "max_num_seqs" in str(err.value)


def test_a_bound_call_no_graph_covers_runs_eagerly(tiny_root):
    """Graphs captured up to batch 2 only: the batch-3 and batch-4 steps take the eager path on
    slices of the buffers, and still land in the bound output."""
    ref = _engine(tiny_root, reference=True)
    fast = _engine(tiny_root, max_graph_batch=2, **STEP_SIZES)
    s_ref, s_fast = _scenario(ref), _scenario(fast)
    buffers = Buffers(fast)
    bound = fast.bind(**buffers.kwargs)
    for plan in _decode_plans():
        expected = ref.propose(**s_ref.call(plan).kwargs).draft_token_ids
        call = {k: ([t.to(DEVICE) for t in v] if isinstance(v, list) else v.to(DEVICE))
                for k, v in s_fast.call(plan).kwargs.items()}
        n, b = buffers.fill(call)
        with allowing(buffers.tensors() + [bound.drafts]):
            assert torch.equal(bound.propose(n, b)[:b].cpu(), expected), plan
    assert fast.graphs.replays == 2, "batches 1-2 by graphs (the prefill and the 2-request step), 3-4 eagerly"


def test_bind_needs_graphs(tiny_root):
    engine = _engine(tiny_root, reference=True)
    with pytest.raises(InvalidInput) as err:
        engine.bind(**Buffers(engine).kwargs)
    assert err.value.field == "engine"
