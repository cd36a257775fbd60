"""What one engine step sends from the leader to the workers, and how a worker rebuilds it.

A draft step carries the call's ProposeInputs (already validated and fused by the leader, block
ids already the leader's pool decisions) plus the padded sizes the leader chose, so every rank
runs the same padded step.  A block wipe carries the group and block ids of a released session.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter.wire.records import ProposeInputs

_SINGLE = ("target_token_ids", "target_positions", "target_hidden_states", "next_token_ids", "query_start_loc",
           "seq_lens", "token_indices_to_sample", "num_rejected_tokens", "temperatures")


@dataclass(frozen=True)
class DraftOptions:
    groups: int
    return_probs: bool
    return_logits: bool
    batch_padded: int
    tokens_padded: int


@dataclass(frozen=True)
class BlockWipe:
    """A released session's blocks of one KV group (their ids are the step's one tensor)."""

    group: int


def draft_tensors(inp: ProposeInputs) -> list[torch.Tensor | None]:
    """A draft step's tensors: the single ones in _SINGLE order, then each KV group's block table,
    then each group's slot mapping."""
    tensors = [getattr(inp, name) for name in _SINGLE]
    return tensors + list(inp.block_tables) + list(inp.slot_mappings)


def draft_inputs(opts: DraftOptions, tensors: list[torch.Tensor | None]) -> ProposeInputs:
    """The ProposeInputs a draft step's tensors carry (the worker's side)."""
    n = len(_SINGLE)
    single = dict(zip(_SINGLE, tensors[:n]))
    tables = list(tensors[n: n + opts.groups])
    slots = list(tensors[n + opts.groups: n + 2 * opts.groups])
    return ProposeInputs(block_tables=tables, slot_mappings=slots, **single)
