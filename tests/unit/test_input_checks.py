"""drafter.engine.inputs.validate decides exactly as its straightforward formulation does: same calls
accepted, same field and message for the ones refused, on valid calls with random corruptions
(extreme values included, where int32 arithmetic would wrap), and its range helpers are exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drafter.attention.metadata import PADDING_SLOT_ID
from drafter.engine.inputs import (FLOAT_DTYPES, INT_DTYPES, Limits, _length, _tensor,
                            as_group_list, out_of_range, validate)
from drafter.wire.errors import InvalidInput
from drafter.wire.records import ProposeInputs
from tests.support.scenario import Scenario

FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
LIMITS = Limits(max_model_len=96, max_num_seqs=6, max_num_batched_tokens=40, vocab_size=50, hidden_width=8,
                num_blocks=(40, 24), block_sizes=(8, 16), draft_span=2)


# ------------------------------------------------------------------ the reference
def _ints(value: torch.Tensor) -> np.ndarray:
    return value.detach().cpu().numpy().astype(np.int64)


def _reference_range(name: str, value: np.ndarray, low: int, high: int) -> None:
    if value.size and (int(value.min()) < low or int(value.max()) >= high):
        raise InvalidInput(name, f"values must lie in [{low}, {high}), got [{int(value.min())}, {int(value.max())}]")


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def reference_validate(inp: ProposeInputs, limits: Limits) -> None:
    """Every check of drafter.engine.inputs.validate written plainly, in int64, in the same order."""
    ids_t = _tensor("target_token_ids", inp.target_token_ids, 1, INT_DTYPES)
    positions_t = _tensor("target_positions", inp.target_positions, 1, INT_DTYPES)
    hidden = _tensor("target_hidden_states", inp.target_hidden_states, 2, FLOAT_DTYPES)
    next_t = _tensor("next_token_ids", inp.next_token_ids, 1, INT_DTYPES)
    qsl_t = _tensor("query_start_loc", inp.query_start_loc, 1, INT_DTYPES)
    seq_lens_t = _tensor("seq_lens", inp.seq_lens, 1, INT_DTYPES)
    n, b = ids_t.shape[0], next_t.shape[0]
    if b == 0:
        raise InvalidInput("next_token_ids", "batch is empty")
    if b > limits.max_num_seqs:
        raise InvalidInput("next_token_ids", f"batch of {b} exceeds max_num_seqs {limits.max_num_seqs}")
    if n > limits.max_num_batched_tokens:
        raise InvalidInput("target_token_ids",
                           f"{n} tokens exceed max_num_batched_tokens {limits.max_num_batched_tokens}")
    _length("target_positions", positions_t, n, "one per token")
    _length("target_hidden_states", hidden, n, "one per token")
    if hidden.shape[1] != limits.hidden_width:
        raise InvalidInput("target_hidden_states", f"width {hidden.shape[1]}, expected {limits.hidden_width}")
    _length("query_start_loc", qsl_t, b + 1, "batch + 1")
    _length("seq_lens", seq_lens_t, b, "one per request")
    _reference_range("target_token_ids", _ints(ids_t), 0, limits.vocab_size)
    _reference_range("next_token_ids", _ints(next_t), 0, limits.vocab_size)
    qsl = _ints(qsl_t)
    if qsl[0] != 0 or qsl[-1] != n:
        raise InvalidInput("query_start_loc", f"must start at 0 and end at num_tokens={n}, got {qsl[0]}..{qsl[-1]}")
    query_lens = np.diff(qsl)
    if query_lens.min() < 1:
        raise InvalidInput("query_start_loc", "must be strictly increasing: every request has at least one token")
    lens = _ints(seq_lens_t)
    bad = (lens < query_lens) | (lens > limits.max_model_len)
    if bad.any():
        r = _first(bad)
        raise InvalidInput("seq_lens", f"request {r}: seq_len {lens[r]} must lie in "
                                       f"[query_len={query_lens[r]}, max_model_len={limits.max_model_len}]")
    positions = _ints(positions_t)
    _reference_range("target_positions", positions, 0, limits.max_model_len)
    owner = np.repeat(np.arange(b), query_lens)
    expected = (lens - query_lens)[owner] + (np.arange(n) - qsl[:-1][owner])
    if not np.array_equal(positions, expected):
        raise InvalidInput("target_positions", "must be each request's last query_len positions before seq_len")
    if inp.num_rejected_tokens is not None:
        rejected_t = _tensor("num_rejected_tokens", inp.num_rejected_tokens, 1, INT_DTYPES)
        _length("num_rejected_tokens", rejected_t, b, "one per request")
        rejected = _ints(rejected_t)
        bad = (rejected < 0) | (rejected >= query_lens)
        if bad.any():
            r = _first(bad)
            raise InvalidInput("num_rejected_tokens", f"request {r}: {rejected[r]} not in [0, query_len={query_lens[r]})")
    if inp.token_indices_to_sample is not None:
        sample_t = _tensor("token_indices_to_sample", inp.token_indices_to_sample, 1, INT_DTYPES)
        _length("token_indices_to_sample", sample_t, b, "one per request")
        sample = _ints(sample_t)
        bad = (sample < qsl[:-1]) | (sample >= qsl[1:])
        if bad.any():
            r = _first(bad)
            raise InvalidInput("token_indices_to_sample",
                               f"request {r}: index {sample[r]} outside its tokens [{qsl[r]}, {qsl[r + 1]})")
    groups = len(limits.num_blocks)
    tables = as_group_list("block_tables", inp.block_tables, groups)
    slots = as_group_list("slot_mappings", inp.slot_mappings, groups)
    horizon = int(min(lens.max() + limits.draft_span, limits.max_model_len))
    for g in range(groups):
        field = f"block_tables[{g}]"
        table_t = _tensor(field, tables[g], 2, INT_DTYPES)
        _length(field, table_t, b, "one row per request")
        bs = limits.block_sizes[g]
        needed = -(-horizon // bs)
        if table_t.shape[1] < needed:
            raise InvalidInput(field, f"has {table_t.shape[1]} columns, the batch needs {needed}")
        table = _ints(table_t)
        _reference_range(field, table, 0, limits.num_blocks[g])
        field = f"slot_mappings[{g}]"
        slot_t = _tensor(field, slots[g], 1, INT_DTYPES)
        _length(field, slot_t, n, "one per token")
        slot = _ints(slot_t)
        expected = table[owner, positions // bs] * bs + positions % bs
        bad = (slot != PADDING_SLOT_ID) & (slot != expected)
        if bad.any():
            i = _first(bad)
            raise InvalidInput(field, f"token {i}: slot {slot[i]} does not match block_tables[{g}] "
                                      f"at position {positions[i]} (expected {expected[i]})")
    if inp.temperatures is not None:
        temps = _tensor("temperatures", inp.temperatures, 1, FLOAT_DTYPES)
        _length("temperatures", temps, b, "one per request")
        if not bool(torch.isfinite(temps).all()) or float(temps.min()) < 0:
            raise InvalidInput("temperatures", "must be finite and >= 0")


def _outcome(check, kw: dict):
    inp = ProposeInputs(kw["target_token_ids"], kw["target_positions"], kw["target_hidden_states"],
                        kw["next_token_ids"], kw["query_start_loc"], kw["seq_lens"], kw["block_tables"],
                        kw["slot_mappings"], kw.get("token_indices_to_sample"), kw.get("num_rejected_tokens"),
                        kw.get("temperatures"))
    try:
        check(inp, LIMITS)
    except InvalidInput as err:
        return err.field, str(err)
    return None


# ------------------------------------------------------------------ calls and corruptions
INT_FIELDS = ("target_token_ids", "target_positions", "next_token_ids", "query_start_loc", "seq_lens",
              "num_rejected_tokens", "token_indices_to_sample", "block_tables", "slot_mappings")
EXTREMES = (-2**63, -2**31 - 1, -2**31, -2**31 + 1, -2, -1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1)


@st.composite
def calls(draw) -> dict:
    scn = Scenario(block_sizes=LIMITS.block_sizes, num_blocks=LIMITS.num_blocks, vocab_size=LIMITS.vocab_size,
                   hidden_width=LIMITS.hidden_width, k=3, max_model_len=LIMITS.max_model_len,
                   seed=draw(st.integers(0, 2**16)))
    for rid in range(3):  # some history, so positions start past 0
        scn.call([(rid, draw(st.integers(1, 12)), 0)])
    plan = [(rid, draw(st.integers(1, 6)), 0) for rid in range(draw(st.integers(1, 3)))]
    plan = [(rid, q, draw(st.integers(0, q - 1))) for rid, q, _ in plan]
    temps = draw(st.none() | st.lists(st.sampled_from([0.0, -0.0, 0.5, 3e38, -1e-30, float("nan"), float("inf")]),
                                      min_size=len(plan), max_size=len(plan)))
    kw = scn.call(plan, padded=draw(st.booleans()), temperatures=temps).kwargs
    if temps is not None:
        kw["temperatures"] = kw["temperatures"].to(draw(st.sampled_from(FLOAT_DTYPES)))
    for _ in range(draw(st.integers(0, 3))):
        _corrupt(draw, kw)
    return kw


def _corrupt(draw, kw: dict) -> None:
    name = draw(st.sampled_from(INT_FIELDS + ("padding",)))
    if name == "padding":  # a token that writes no KV (slot -1 in every group): valid
        i = draw(st.integers(0, kw["target_token_ids"].shape[0] - 1))
        kw["slot_mappings"] = [t.clone().index_fill_(0, torch.tensor([i]), PADDING_SLOT_ID) for t in kw["slot_mappings"]]
        return
    if kw.get(name) is None:
        return
    g = draw(st.integers(0, len(LIMITS.block_sizes) - 1)) if name in ("block_tables", "slot_mappings") else None
    t = (kw[name][g] if g is not None else kw[name]).clone()
    dtype = draw(st.sampled_from(INT_DTYPES))
    flat = t.view(-1)
    i = draw(st.integers(0, flat.numel() - 1))
    old = int(flat[i])
    value = draw(st.sampled_from(EXTREMES) | st.integers(max(old - 3, -2**63), min(old + 3, 2**63 - 1))
                 | st.integers(-200, 200))
    if dtype == torch.int32 and not -2**31 <= value < 2**31:
        dtype = torch.int64
    t = t.to(dtype)
    t.view(-1)[i] = value
    if g is not None:
        kw[name] = list(kw[name])
        kw[name][g] = t
    else:
        kw[name] = t


@settings(max_examples=600, **FUZZ)
@given(kw=calls())
def test_validate_decides_as_the_plain_formulation(kw):
    assert _outcome(validate, kw) == _outcome(reference_validate, kw)


def test_the_fuzzed_calls_are_mostly_refused_and_sometimes_accepted():
    """The property above covers both outcomes (a generator that only made broken calls would prove little)."""
    seen = set()

    @settings(max_examples=300, **FUZZ)
    @given(kw=calls())
    def collect(kw):
        outcome = _outcome(validate, kw)
        seen.add(None if outcome is None else outcome[0].split("[")[0])

    collect()
    assert {None, "seq_lens", "target_positions", "num_rejected_tokens", "token_indices_to_sample", "block_tables",
            "slot_mappings", "temperatures"} <= seen


# ------------------------------------------------------------------ the range helper
@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64])
@pytest.mark.parametrize("low,high", [(0, 1), (0, 50), (-1, 1 << 20), (1, 97), (0, 2**31), (-1, 2**33), (0, 2**62), (5, 6)])
def test_out_of_range_is_exact_at_every_edge(dtype, low, high):
    info = np.iinfo(dtype)
    candidates = {info.min, info.min + 1, -2, -1, 0, 1, 2, low - 1, low, low + 1, high - 1, high, high + 1,
                  info.max - 1, info.max}
    for v in sorted(c for c in candidates if info.min <= c <= info.max):
        values = np.array([low, v, max(low, 0)], dtype=dtype)
        assert out_of_range(values, low, high) == (not low <= v < high), (dtype, low, high, v)
    assert not out_of_range(np.zeros(0, dtype=dtype), low, high)


def test_slots_of_a_pool_past_int32_are_computed_without_wrapping():
    """int32 block tables and positions, a pool of 2**28 blocks of 16: slot ids reach 2**32."""
    limits = Limits(max_model_len=96, max_num_seqs=1, max_num_batched_tokens=1, vocab_size=50, hidden_width=8,
                    num_blocks=(2**28,), block_sizes=(16,), draft_span=0)
    block, position = 2**28 - 3, 37

    def one_token(slot: int) -> ProposeInputs:
        ints = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        return ProposeInputs(ints(1), ints(position), torch.zeros(1, 8), ints(2), ints(0, 1), ints(position + 1),
                             [torch.full((1, 6), block, dtype=torch.int32)], [torch.tensor([slot])])

    validate(one_token(block * 16 + position % 16), limits)
    with pytest.raises(InvalidInput, match="slot_mappings"):
        validate(one_token(block * 16 + position % 16 - 2**32), limits)  # what int32 arithmetic would compute
