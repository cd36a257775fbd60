"""Several sessions' validated, already shifted requests concatenated into one engine call.

The parts' tensors may live on the host (the batcher's requests) or on the engine's device (bound
steps' guarded rows, drafter.service.batching.bound_steps): what is made here is made where the
parts are."""

from __future__ import annotations

import torch

from drafter.wire.records import ProposeInputs


def _default_sample_indices(inp: ProposeInputs) -> torch.Tensor:  # [batch] int64, the engine's own default
    idx = inp.query_start_loc[1:].long() - 1
    if inp.num_rejected_tokens is not None:
        idx = idx - inp.num_rejected_tokens.long()
    return idx


def fuse(parts: list[ProposeInputs], pads: list[tuple[int, ...]], hidden_dtype: torch.dtype
         ) -> tuple[ProposeInputs, list[tuple[int, int]]]:
    """Concatenate validated, already shifted requests into one engine call.

    pads[i][g]: a block id inside request i's own range, used to widen its block tables (the
    extra columns lie past every position it can reach, so they are never read or written).
    Returns the fused inputs and each request's rows [start, end) of the drafts.
    """
    token_offsets, rows, t, b = [], [], 0, 0
    for p in parts:
        token_offsets.append(t)
        rows.append((b, b + p.batch_size))
        t, b = t + p.num_tokens, b + p.batch_size
    ints = lambda ts: torch.cat([x.to(torch.int64) for x in ts])  # noqa: E731
    qsl = [torch.zeros(1, dtype=torch.int64, device=parts[0].query_start_loc.device)] + [p.query_start_loc[1:].to(torch.int64) + off
                                                 for p, off in zip(parts, token_offsets)]
    hidden = [p.target_hidden_states for p in parts]
    # shared (CUDA IPC) states live on the GPU: a batch that has any is concatenated there
    device = next((h.device for h in hidden if h.device.type != "cpu"), hidden[0].device)
    groups = range(len(pads[0]))
    return ProposeInputs(
        target_token_ids=ints([p.target_token_ids for p in parts]),
        target_positions=ints([p.target_positions for p in parts]),
        target_hidden_states=torch.cat([h.to(device, hidden_dtype) for h in hidden]),
        next_token_ids=ints([p.next_token_ids for p in parts]),
        query_start_loc=torch.cat(qsl),
        seq_lens=ints([p.seq_lens for p in parts]),
        block_tables=[_widened_tables(parts, pads, g) for g in groups],
        slot_mappings=[torch.cat([p.slot_mappings[g] for p in parts]) for g in groups],
        token_indices_to_sample=_fused_sample_indices(parts, token_offsets),
        num_rejected_tokens=_fused_optional(parts, lambda p: p.num_rejected_tokens, torch.int64),
        temperatures=_fused_optional(parts, lambda p: p.temperatures, torch.float32),
    ), rows


def _widened_tables(parts: list[ProposeInputs], pads, g: int) -> torch.Tensor:  # [batch, width] int
    width = max(p.block_tables[g].shape[1] for p in parts)
    out = []
    for p, pad in zip(parts, pads):
        tb = p.block_tables[g]
        if tb.shape[1] < width:
            tb = torch.cat([tb, torch.full((tb.shape[0], width - tb.shape[1]), pad[g], dtype=tb.dtype,
                                           device=tb.device)], 1)
        out.append(tb)
    return torch.cat(out)


def _fused_optional(parts: list[ProposeInputs], get, dtype: torch.dtype) -> torch.Tensor | None:  # [batch]
    """A per-request optional tensor across the batch; zeros (the engine's default) where a request has none."""
    if all(get(p) is None for p in parts):
        return None
    return torch.cat([get(p).to(dtype) if get(p) is not None
                      else torch.zeros(p.batch_size, dtype=dtype, device=p.next_token_ids.device) for p in parts])


def _fused_sample_indices(parts: list[ProposeInputs], token_offsets: list[int]) -> torch.Tensor | None:  # [batch]
    if all(p.token_indices_to_sample is None for p in parts):
        return None
    return torch.cat([(p.token_indices_to_sample.to(torch.int64) if p.token_indices_to_sample is not None
                       else _default_sample_indices(p)) + off for p, off in zip(parts, token_offsets)])
