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

INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class InvalidInput(ValueError):
    """A propose call's input is malformed; `field` names the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class ProposeInputs:
    target_token_ids: torch.Tensor  # [num_tokens] int
    target_positions: torch.Tensor  # [num_tokens] int
    target_hidden_states: torch.Tensor  # [num_tokens, hidden_input_width] float
    next_token_ids: torch.Tensor  # [batch] int
    query_start_loc: torch.Tensor  # [batch + 1] int
    seq_lens: torch.Tensor  # [batch] int, includes this step's tokens (and rejected ones, padded path)
    block_tables: list[torch.Tensor]  # per KV group: [batch, max_blocks] int
    slot_mappings: list[torch.Tensor]  # per KV group: [num_tokens] int, -1 = write nothing
    token_indices_to_sample: torch.Tensor | None = None  # [batch] int
    num_rejected_tokens: torch.Tensor | None = None  # [batch] int
    temperatures: torch.Tensor | None = None  # [batch] float, 0 = greedy

    @property
    def num_tokens(self) -> int:
        return self.target_token_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return self.next_token_ids.shape[0]


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


def _in_range(name: str, value: np.ndarray, low: int, high: int) -> None:
    if value.size and (int(value.min()) < low or int(value.max()) >= high):
        raise InvalidInput(name, f"values must lie in [{low}, {high}), got [{int(value.min())}, {int(value.max())}]")


def _host(value: torch.Tensor) -> np.ndarray:
    """Small integer metadata as an int64 numpy array (zero-copy for CPU tensors): numpy's
    per-call overhead is a fraction of torch's, and validation sits on every step's path."""
    return value.detach().cpu().numpy().astype(np.int64, copy=False)


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


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
    qsl = _host(qsl_t)
    if qsl[0] != 0 or qsl[-1] != n:
        raise InvalidInput("query_start_loc", f"must start at 0 and end at num_tokens={n}, got {qsl[0]}..{qsl[-1]}")
    query_lens = np.diff(qsl)
    if query_lens.min() < 1:
        raise InvalidInput("query_start_loc", "must be strictly increasing: every request has at least one token")
    lens = _host(seq_lens_t)
    bad = (lens < query_lens) | (lens > limits.max_model_len)
    if bad.any():
        r = _first_bad(bad)
        raise InvalidInput("seq_lens", f"request {r}: seq_len {lens[r]} must lie in "
                                       f"[query_len={query_lens[r]}, max_model_len={limits.max_model_len}]")
    positions = _host(positions_t)
    _in_range("target_positions", positions, 0, limits.max_model_len)
    owner = np.repeat(np.arange(b), query_lens)  # request of each token
    expected = (lens - query_lens)[owner] + (np.arange(n) - qsl[:-1][owner])
    if not np.array_equal(positions, expected):
        raise InvalidInput("target_positions", "must be each request's last query_len positions before seq_len")
    _validate_rejection(inp, query_lens, qsl)
    _validate_kv(inp, limits, positions, owner, lens)
    if inp.temperatures is not None:
        temps = _tensor("temperatures", inp.temperatures, 1, FLOAT_DTYPES)
        _length("temperatures", temps, b, "one per request")
        if not bool(torch.isfinite(temps).all()) or float(temps.min()) < 0:
            raise InvalidInput("temperatures", "must be finite and >= 0")


def _validate_rejection(inp: ProposeInputs, query_lens: np.ndarray, qsl: np.ndarray) -> None:
    b = len(query_lens)
    if inp.num_rejected_tokens is not None:
        rejected_t = _tensor("num_rejected_tokens", inp.num_rejected_tokens, 1, INT_DTYPES)
        _length("num_rejected_tokens", rejected_t, b, "one per request")
        rejected = _host(rejected_t)
        bad = (rejected < 0) | (rejected >= query_lens)
        if bad.any():
            r = _first_bad(bad)
            raise InvalidInput("num_rejected_tokens", f"request {r}: {rejected[r]} not in [0, query_len={query_lens[r]})")
    if inp.token_indices_to_sample is not None:
        sample_t = _tensor("token_indices_to_sample", inp.token_indices_to_sample, 1, INT_DTYPES)
        _length("token_indices_to_sample", sample_t, b, "one per request")
        sample = _host(sample_t)
        bad = (sample < qsl[:-1]) | (sample >= qsl[1:])
        if bad.any():
            r = _first_bad(bad)
            raise InvalidInput("token_indices_to_sample",
                               f"request {r}: index {sample[r]} outside its tokens [{qsl[r]}, {qsl[r + 1]})")


def _validate_kv(inp: ProposeInputs, limits: Limits, positions: np.ndarray, owner: np.ndarray,
                 lens: np.ndarray) -> None:
    groups = len(limits.num_blocks)
    tables = as_group_list("block_tables", inp.block_tables, groups)
    slots = as_group_list("slot_mappings", inp.slot_mappings, groups)
    b, n = len(lens), len(positions)
    # the furthest position a draft step may write, over the batch
    horizon = int(min(lens.max() + limits.draft_span, limits.max_model_len))
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
        expected = table[owner, positions // bs] * bs + positions % bs
        bad = (slot != PADDING_SLOT_ID) & (slot != expected)
        if bad.any():
            i = _first_bad(bad)
            raise InvalidInput(field, f"token {i}: slot {slot[i]} does not match block_tables[{g}] "
                                      f"at position {positions[i]} (expected {expected[i]})")
