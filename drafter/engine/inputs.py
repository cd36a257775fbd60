"""The tensors of one propose call, checked before anything touches the KV pool or a GPU.

Field names are those of vLLM's proposer so a target engine passes what it already has.
Every failure raises InvalidInput naming the offending field; nothing is written before
validation has passed, so a bad call leaves the KV pool exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from drafter.attention.metadata import PADDING_SLOT_ID
from drafter.wire.errors import InvalidInput
from drafter.wire.records import ProposeInputs

INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Limits:
    """What the engine (or a session) accepts; plain values handed down from the config."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int
    hidden_width: int
    num_blocks: tuple[int, ...]  # per KV group
    block_sizes: tuple[int, ...]  # per KV group
    draft_span: int  # positions past seq_len that draft steps may write (k - 1, or the tree's nodes)


def _tensor(name: str, value, ndim: int, dtypes) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidInput(name, f"expected a tensor, got {type(value).__name__}")
    if value.dim() != ndim:
        raise InvalidInput(name, f"expected {ndim} dimensions, got shape {tuple(value.shape)}")
    if value.dtype not in dtypes:
        raise InvalidInput(name, f"dtype {value.dtype} not allowed, expected one of {dtypes}")
    return value


def _length(name: str, value: torch.Tensor, expected: int, what: str) -> None:
    if value.shape[0] != expected:
        raise InvalidInput(name, f"has {value.shape[0]} rows, expected {expected} ({what})")


# Range checks cost one unsigned view and one argmax on the success path: a value below `low` reads
# as a huge unsigned number once `low` is subtracted, so [low, high) is a single upper bound; and
# argmax + item is several times cheaper per call than max(), which goes through numpy's reduction
# machinery (these arrays are small: the call overhead is the cost).
_UNSIGNED = {np.dtype(np.int32): np.uint32, np.dtype(np.int64): np.uint64}
_TOP = {np.dtype(np.int32): 2**31, np.dtype(np.int64): 2**63}  # one past each dtype's largest value


def _max(a: np.ndarray) -> int:  # a is not empty
    return a.item(a.argmax())


def _min(a: np.ndarray) -> int:  # a is not empty
    return a.item(a.argmin())


def out_of_range(values: np.ndarray, low: int, high: int) -> bool:
    """True when some value of an integer array lies outside [low, high) (low < high, low a value of
    the dtype).

    values - low, read as unsigned, is exactly the distance above low for every value >= low, and
    at least _TOP - low for every value below it (the subtraction wraps around at most once)."""
    if not values.size:
        return False
    unsigned = _UNSIGNED.get(values.dtype)
    if unsigned is None:  # a dtype no call carries (the checks accept int32 and int64 only): plainly
        return _min(values) < low or _max(values) >= high
    distance = (values - low if low else values).view(unsigned)
    return _max(distance) >= min(high, _TOP[values.dtype]) - low


def _in_range(name: str, values: np.ndarray, low: int, high: int) -> None:
    if out_of_range(values, low, high):
        raise InvalidInput(name, f"values must lie in [{low}, {high}), got [{_min(values)}, {_max(values)}]")


def _outside(values: np.ndarray, start: np.ndarray | int, length: np.ndarray) -> np.ndarray:
    """Where values do not lie in [start, start + length).  start: an int64 array >= 0, or 0; length:
    an int64 array >= 1; start + length < 2**31.  One subtraction and one unsigned compare: as in
    out_of_range, the unsigned difference is below length exactly for the values inside."""
    diff = values - start if isinstance(start, np.ndarray) else values
    return diff.view(_UNSIGNED[diff.dtype]) >= length.view(np.uint64)


def _host(value: torch.Tensor) -> np.ndarray:
    """Integer metadata as a numpy array, zero-copy for CPU tensors (integer tensors carry no grad):
    numpy's per-call overhead is a fraction of torch's, and validation sits on every step's path."""
    return value.numpy() if value.is_cpu else value.detach().cpu().numpy()


def _first_bad(mask: np.ndarray) -> int | None:
    """The first True of a boolean mask, None when there is none (argmax: cheaper than any())."""
    i = mask.argmax()
    return int(i) if mask[i] else None


def as_group_list(name: str, value, num_groups: int) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise InvalidInput(name, f"expected a tensor or a list of tensors, got {type(value).__name__}")
    if len(value) != num_groups:
        raise InvalidInput(name, f"expected one entry per KV group ({num_groups}), got {len(value)}")
    return list(value)


def validate(inp: ProposeInputs, limits: Limits) -> None:
    """Check dtypes, shapes, ranges and their agreement; raise InvalidInput on the first problem."""
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
    _in_range("target_token_ids", _host(ids_t), 0, limits.vocab_size)
    _in_range("next_token_ids", _host(next_t), 0, limits.vocab_size)
    qsl = _host(qsl_t).astype(np.int64, copy=False)  # int64: the differences of int32 ones could wrap
    if qsl[0] != 0 or qsl[-1] != n:
        raise InvalidInput("query_start_loc", f"must start at 0 and end at num_tokens={n}, got {qsl[0]}..{qsl[-1]}")
    query_lens = qsl[1:] - qsl[:-1]
    if _min(query_lens) < 1:
        raise InvalidInput("query_start_loc", "must be strictly increasing: every request has at least one token")
    lens = _host(seq_lens_t)
    # lens within [0, max_model_len] first, so that lens - query_lens cannot wrap around
    if out_of_range(lens, 0, limits.max_model_len + 1) or _min(context := lens - query_lens) < 0:
        r = _first_bad((lens < query_lens) | (lens > limits.max_model_len))
        raise InvalidInput("seq_lens", f"request {r}: seq_len {lens[r]} must lie in "
                                       f"[query_len={query_lens[r]}, max_model_len={limits.max_model_len}]")
    positions = _host(positions_t)
    _in_range("target_positions", positions, 0, limits.max_model_len)
    # token i of request r must sit at position context[r] + (i - qsl[r]): its position minus i is one
    # number per request (every operand is in range by now: nothing can wrap)
    owner = np.repeat(np.arange(b), query_lens)  # request of each token
    if _first_bad(positions - np.arange(n) != (context - qsl[:-1])[owner]) is not None:
        raise InvalidInput("target_positions", "must be each request's last query_len positions before seq_len")
    _validate_rejection(inp, query_lens, qsl)
    _validate_kv(inp, limits, positions, owner, b, _max(lens))
    if inp.temperatures is not None:
        temps = _tensor("temperatures", inp.temperatures, 1, FLOAT_DTYPES)
        _length("temperatures", temps, b, "one per request")
        if not _finite_non_negative(temps):
            raise InvalidInput("temperatures", "must be finite and >= 0")


def _finite_non_negative(t: torch.Tensor) -> bool:  # [batch] float
    if t.is_cpu and t.dtype != torch.bfloat16:  # numpy has no bfloat16
        a = t.detach().numpy()
        return bool(((a >= 0) & (a < np.inf)).all())  # NaN fails both comparisons
    return bool(torch.isfinite(t).all()) and float(t.min()) >= 0


def _validate_rejection(inp: ProposeInputs, query_lens: np.ndarray, qsl: np.ndarray) -> None:
    b = len(query_lens)
    if inp.num_rejected_tokens is not None:
        rejected_t = _tensor("num_rejected_tokens", inp.num_rejected_tokens, 1, INT_DTYPES)
        _length("num_rejected_tokens", rejected_t, b, "one per request")
        rejected = _host(rejected_t)
        r = _first_bad(_outside(rejected, 0, query_lens))
        if r is not None:
            raise InvalidInput("num_rejected_tokens", f"request {r}: {rejected[r]} not in [0, query_len={query_lens[r]})")
    if inp.token_indices_to_sample is not None:
        sample_t = _tensor("token_indices_to_sample", inp.token_indices_to_sample, 1, INT_DTYPES)
        _length("token_indices_to_sample", sample_t, b, "one per request")
        sample = _host(sample_t)
        r = _first_bad(_outside(sample, qsl[:-1], query_lens))
        if r is not None:
            raise InvalidInput("token_indices_to_sample",
                               f"request {r}: index {sample[r]} outside its tokens [{qsl[r]}, {qsl[r + 1]})")


def _validate_kv(inp: ProposeInputs, limits: Limits, positions: np.ndarray, owner: np.ndarray, b: int,
                 max_seq_len: int) -> None:
    groups = len(limits.num_blocks)
    tables = as_group_list("block_tables", inp.block_tables, groups)
    slots = as_group_list("slot_mappings", inp.slot_mappings, groups)
    n = len(positions)
    # the furthest position a draft step may write, over the batch
    horizon = min(max_seq_len + limits.draft_span, limits.max_model_len)
    for g in range(groups):
        field = f"block_tables[{g}]"
        table_t = _tensor(field, tables[g], 2, INT_DTYPES)
        _length(field, table_t, b, "one row per request")
        bs = limits.block_sizes[g]
        needed = -(-horizon // bs)
        if table_t.shape[1] < needed:
            raise InvalidInput(field, f"has {table_t.shape[1]} columns, the batch needs {needed}")
        table = _host(table_t)
        _in_range(field, table, 0, limits.num_blocks[g])
        field = f"slot_mappings[{g}]"
        slot_t = _tensor(field, slots[g], 1, INT_DTYPES)
        _length(field, slot_t, n, "one per token")
        slot = _host(slot_t)
        column = positions // bs
        # table * bs + positions % bs, in int64 (block id x block size may exceed int32 in a large pool)
        expected = (table[owner, column] - column).astype(np.int64, copy=False) * bs + positions
        bad = slot != expected
        if _first_bad(bad) is not None:  # padding tokens (no slot) are the only exception: rare, so looked at here
            i = _first_bad(bad & (slot != PADDING_SLOT_ID))
            if i is not None:
                raise InvalidInput(field, f"token {i}: slot {slot[i]} does not match block_tables[{g}] "
                                          f"at position {positions[i]} (expected {expected[i]})")
