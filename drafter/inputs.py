"""The tensors of one propose call, checked before anything touches the KV pool or a GPU.

Field names are those of vLLM's proposer so a target engine passes what it already has.
Every failure raises InvalidInput naming the offending field; nothing is written before
validation has passed, so a bad call leaves the KV pool exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def _in_range(name: str, value: torch.Tensor, low: int, high: int) -> None:
    if value.numel() and (int(value.min()) < low or int(value.max()) >= high):
        raise InvalidInput(name, f"values must lie in [{low}, {high}), got [{int(value.min())}, {int(value.max())}]")


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
    ids = _tensor("target_token_ids", inp.target_token_ids, 1, INT_DTYPES)
    positions = _tensor("target_positions", inp.target_positions, 1, INT_DTYPES)
    hidden = _tensor("target_hidden_states", inp.target_hidden_states, 2, FLOAT_DTYPES)
    next_ids = _tensor("next_token_ids", inp.next_token_ids, 1, INT_DTYPES)
    qsl = _tensor("query_start_loc", inp.query_start_loc, 1, INT_DTYPES)
    seq_lens = _tensor("seq_lens", inp.seq_lens, 1, INT_DTYPES)
    n, b = ids.shape[0], next_ids.shape[0]
    if b == 0:
        raise InvalidInput("next_token_ids", "batch is empty")
    if b > limits.max_num_seqs:
        raise InvalidInput("next_token_ids", f"batch of {b} exceeds max_num_seqs {limits.max_num_seqs}")
    if n > limits.max_num_batched_tokens:
        raise InvalidInput("target_token_ids",
                           f"{n} tokens exceed max_num_batched_tokens {limits.max_num_batched_tokens}")
    _length("target_positions", positions, n, "one per token")
    _length("target_hidden_states", hidden, n, "one per token")
    if hidden.shape[1] != limits.hidden_width:
        raise InvalidInput("target_hidden_states", f"width {hidden.shape[1]}, expected {limits.hidden_width}")
    _length("query_start_loc", qsl, b + 1, "batch + 1")
    _length("seq_lens", seq_lens, b, "one per request")
    _in_range("target_token_ids", ids, 0, limits.vocab_size)
    _in_range("next_token_ids", next_ids, 0, limits.vocab_size)
    starts = qsl.tolist()
    if starts[0] != 0 or starts[-1] != n:
        raise InvalidInput("query_start_loc", f"must start at 0 and end at num_tokens={n}, got {starts[0]}..{starts[-1]}")
    query_lens = [starts[i + 1] - starts[i] for i in range(b)]
    if min(query_lens) < 1:
        raise InvalidInput("query_start_loc", "must be strictly increasing: every request has at least one token")
    lens = seq_lens.tolist()
    for r in range(b):
        if not query_lens[r] <= lens[r] <= limits.max_model_len:
            raise InvalidInput("seq_lens", f"request {r}: seq_len {lens[r]} must lie in "
                                           f"[query_len={query_lens[r]}, max_model_len={limits.max_model_len}]")
    _in_range("target_positions", positions, 0, limits.max_model_len)
    expected_pos = torch.cat([torch.arange(lens[r] - query_lens[r], lens[r]) for r in range(b)])
    if not torch.equal(positions.cpu().long(), expected_pos):
        raise InvalidInput("target_positions", "must be each request's last query_len positions before seq_len")
    _validate_rejection(inp, query_lens, starts)
    _validate_kv(inp, limits, positions.cpu().long(), query_lens, lens)
    if inp.temperatures is not None:
        temps = _tensor("temperatures", inp.temperatures, 1, FLOAT_DTYPES)
        _length("temperatures", temps, b, "one per request")
        if not bool(torch.isfinite(temps).all()) or float(temps.min()) < 0:
            raise InvalidInput("temperatures", "must be finite and >= 0")


def _validate_rejection(inp: ProposeInputs, query_lens: list[int], starts: list[int]) -> None:
    b = len(query_lens)
    if inp.num_rejected_tokens is not None:
        rejected = _tensor("num_rejected_tokens", inp.num_rejected_tokens, 1, INT_DTYPES)
        _length("num_rejected_tokens", rejected, b, "one per request")
        for r, count in enumerate(rejected.tolist()):
            if not 0 <= count < query_lens[r]:
                raise InvalidInput("num_rejected_tokens", f"request {r}: {count} not in [0, query_len={query_lens[r]})")
    if inp.token_indices_to_sample is not None:
        sample = _tensor("token_indices_to_sample", inp.token_indices_to_sample, 1, INT_DTYPES)
        _length("token_indices_to_sample", sample, b, "one per request")
        for r, idx in enumerate(sample.tolist()):
            if not starts[r] <= idx < starts[r + 1]:
                raise InvalidInput("token_indices_to_sample",
                                   f"request {r}: index {idx} outside its tokens [{starts[r]}, {starts[r + 1]})")


def _validate_kv(inp: ProposeInputs, limits: Limits, positions: torch.Tensor, query_lens, lens) -> None:
    groups = len(limits.num_blocks)
    tables = as_group_list("block_tables", inp.block_tables, groups)
    slots = as_group_list("slot_mappings", inp.slot_mappings, groups)
    b, n = len(lens), positions.shape[0]
    owner = torch.repeat_interleave(torch.arange(b), torch.tensor(query_lens))
    # the furthest position a draft step may write for each request
    horizon = torch.tensor([min(l + limits.draft_span, limits.max_model_len) for l in lens])
    for g in range(groups):
        field = f"block_tables[{g}]"
        table = _tensor(field, tables[g], 2, INT_DTYPES)
        _length(field, table, b, "one row per request")
        bs = limits.block_sizes[g]
        needed = int(-(-int(horizon.max()) // bs))
        if table.shape[1] < needed:
            raise InvalidInput(field, f"has {table.shape[1]} columns, the batch needs {needed}")
        _in_range(field, table, 0, limits.num_blocks[g])
        field = f"slot_mappings[{g}]"
        slot = _tensor(field, slots[g], 1, INT_DTYPES).cpu().long()
        _length(field, slot, n, "one per token")
        t = table.cpu().long()
        expected = t[owner, positions // bs] * bs + positions % bs
        written = slot != PADDING_SLOT_ID
        if not torch.equal(slot[written], expected[written]):
            bad = int((written & (slot != expected)).nonzero()[0])
            raise InvalidInput(field, f"token {bad}: slot {int(slot[bad])} does not match block_tables[{g}] "
                                      f"at position {int(positions[bad])} (expected {int(expected[bad])})")
