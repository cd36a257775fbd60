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


def draft_message(inp: ProposeInputs, opts: DraftOptions) -> tuple[dict, list[torch.Tensor | None]]:
    """(options, tensors) of a draft step: the single tensors in _SINGLE order, then each KV group's
    block table, then each group's slot mapping."""
    tensors = [getattr(inp, name) for name in _SINGLE]
    tensors += list(inp.block_tables) + list(inp.slot_mappings)
    return vars(opts).copy(), tensors


def draft_inputs(options: dict, tensors: list[torch.Tensor | None]) -> tuple[ProposeInputs, DraftOptions]:
    """The ProposeInputs and options a draft step's message carries (the worker's side)."""
    opts = DraftOptions(**options)
    n = len(_SINGLE)
    single = dict(zip(_SINGLE, tensors[:n]))
    tables = list(tensors[n: n + opts.groups])
    slots = list(tensors[n + opts.groups: n + 2 * opts.groups])
    return ProposeInputs(block_tables=tables, slot_mappings=slots, **single), opts
