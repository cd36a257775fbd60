"""Static input buffers, sized once, that every propose call is padded into.

Keeping the addresses fixed is what lets a CUDA graph replay a step; padding to a capture
size keeps the number of distinct shapes small.  Padded token rows get slot -1 and belong
to no request; padded requests get seq_len 0: they write nothing and read nothing.
"""

from __future__ import annotations

import torch

from drafter.attention.metadata import PADDING_SLOT_ID, AttentionMetadata
from drafter.wire.records import ProposeInputs


class StaticBuffers:
    def __init__(self, max_tokens: int, max_batch: int, hidden_width: int, blocks_per_req: tuple[int, ...],
                 block_sizes: tuple[int, ...], device, dtype):
        kw = dict(device=device)
        self.block_sizes = block_sizes
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, **kw)  # [max_tokens]
        self.positions = torch.zeros(max_tokens, dtype=torch.long, **kw)  # [max_tokens]
        self.hidden = torch.zeros(max_tokens, hidden_width, dtype=dtype, **kw)  # [max_tokens, width]
        self.slot_mappings = [torch.full((max_tokens,), PADDING_SLOT_ID, dtype=torch.long, **kw)
                              for _ in block_sizes]  # per group: [max_tokens]
        self.query_start_loc = torch.zeros(max_batch + 1, dtype=torch.int32, **kw)  # [max_batch + 1]
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, **kw)  # [max_batch]
        self.block_tables = [torch.zeros(max_batch, w, dtype=torch.int32, **kw)
                             for w in blocks_per_req]  # per group: [max_batch, blocks_per_req]
        self.sample_indices = torch.zeros(max_batch, dtype=torch.long, **kw)  # [max_batch]
        self.temperatures = torch.zeros(max_batch, dtype=torch.float32, **kw)  # [max_batch]

    def load(self, inp: ProposeInputs, num_tokens_padded: int, batch_padded: int) -> None:
        """Copy a validated batch in; zero or neutralise every row up to the padded sizes."""
        n, b = inp.num_tokens, inp.batch_size
        ids = inp.target_token_ids.to(self.input_ids.device, torch.long)
        self.input_ids[:num_tokens_padded].zero_()
        self.input_ids[: n - 1] = ids[1:]  # the drafter sees token t+1 beside hidden state t
        sample = inp.token_indices_to_sample
        if sample is None:
            sample = inp.query_start_loc[1:] - 1
            if inp.num_rejected_tokens is not None:
                sample = sample - inp.num_rejected_tokens
        self.sample_indices[:batch_padded].zero_()
        self.sample_indices[:b] = sample.to(self.sample_indices.device, torch.long)
        self.input_ids[self.sample_indices[:b]] = inp.next_token_ids.to(self.input_ids.device, torch.long)
        self.positions[:num_tokens_padded].zero_()
        self.positions[:n] = inp.target_positions
        self.hidden[:num_tokens_padded].zero_()
        self.hidden[:n] = inp.target_hidden_states
        self.query_start_loc[: batch_padded + 1] = n
        self.query_start_loc[: b + 1] = inp.query_start_loc
        self.seq_lens[:batch_padded].zero_()
        self.seq_lens[:b] = inp.seq_lens
        for g, (table, slots) in enumerate(zip(inp.block_tables, inp.slot_mappings)):
            width = min(table.shape[1], self.block_tables[g].shape[1])
            self.block_tables[g][:batch_padded].zero_()
            self.block_tables[g][:b, :width] = table[:, :width]
            self.slot_mappings[g][:num_tokens_padded].fill_(PADDING_SLOT_ID)
            self.slot_mappings[g][:n] = slots
        self.temperatures[:batch_padded].zero_()
        if inp.temperatures is not None:
            self.temperatures[:b] = inp.temperatures

    def first_pass_metadata(self, num_tokens: int, batch: int) -> list[AttentionMetadata]:
        return [
            AttentionMetadata(
                query_start_loc=self.query_start_loc[: batch + 1],
                seq_lens=self.seq_lens[:batch],
                block_table=self.block_tables[g][:batch],
                slot_mapping=self.slot_mappings[g][:num_tokens],
                block_size=bs,
            )
            for g, bs in enumerate(self.block_sizes)
        ]
