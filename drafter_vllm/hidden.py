"""The hidden states a step sends, built straight into the bound session's buffer where there is one.

EAGLE-3 drafts from several target layers' hidden states side by side ([num_tokens, layers *
hidden]).  Model Runner V2 hands them over as one tensor per layer; joining them with torch.cat
and then copying the result into the bound session's registered buffer costs two copies of every
byte.  Where the RemoteProposer's transport has a live binding whose buffer the next step fills
from (coordinator.transport.bound_transport.BoundTransport.hidden_rows), each layer is copied
straight into its column block of that buffer instead (one copy per layer), and the step passes
that view on as its hidden states: the transport's own copy of it then has nothing to do (the
source and destination are the same memory, which torch's copy_ leaves alone).  The bytes the
step ships are the same either way.  vLLM-free.
"""

from __future__ import annotations

import torch


def bound_hidden_rows(source, num_tokens: int, width: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor | None:
    """[num_tokens, width] of the bound buffer the RemoteProposer `source`'s next bound step fills
    from, on `device` in `dtype`; None where there is none (no source yet, not bound, another
    transport, the rows or width do not fit)."""
    transports = getattr(source, "transports", None)
    transport = transports.get(getattr(source, "endpoint", None)) if isinstance(transports, dict) else None
    rows = getattr(transport, "hidden_rows", None)
    return rows(num_tokens, width, dtype, torch.device(device)) if rows is not None else None


def join_layers(layers, num_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The layers' first num_tokens rows side by side: [num_tokens, sum of widths].

    layers: EAGLE-3's aux hidden states, each [>= num_tokens, hidden]; out: [num_tokens, sum of
    widths] to write them into (one copy per layer into its column block), or None for torch.cat."""
    if out is None:
        return torch.cat([h[:num_tokens] for h in layers], dim=-1)
    total = sum(h.shape[-1] for h in layers)
    if tuple(out.shape) != (num_tokens, total):
        raise ValueError(f"layers of {total} columns into {tuple(out.shape)} for {num_tokens} tokens")
    col = 0
    for h in layers:
        out[:, col:col + h.shape[-1]].copy_(h[:num_tokens])
        col += h.shape[-1]
    return out
