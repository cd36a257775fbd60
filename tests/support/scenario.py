"""Simulated target-side decoding that produces realistic propose calls for tests.

Each request gets its own (fresh, randomly chosen) blocks in every KV group, a prompt, then
decode steps whose queries are [bonus token, k drafts] with a random number of rejected
tokens, exactly as a target engine with speculative decoding would send them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    rid: int
    blocks: list[list[int]]  # per KV group
    next_pos: int = 0  # first position of the next query
    pending_token: int = 0  # the bonus token that starts the next query


@dataclass
class Call:
    """One propose call, plus what a dense reference needs to replay it."""

    kwargs: dict
    request_ids: list[int]
    # per request: (positions, shifted input ids, hidden rows, index of the sampled row within the query)
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]


class Scenario:
    def __init__(self, *, block_sizes, num_blocks, vocab_size, hidden_width, k, max_model_len, seed=0,
                 draft_span=None, dtype=torch.float32):
        self.g = torch.Generator().manual_seed(seed)
        self.block_sizes = block_sizes
        self.vocab = vocab_size
        self.width = hidden_width
        self.k = k
        self.max_model_len = max_model_len
        self.draft_span = k - 1 if draft_span is None else draft_span
        self.dtype = dtype
        self.free = [torch.randperm(n, generator=self.g).tolist() for n in num_blocks]
        self.requests: dict[int, Request] = {}
        self.width_blocks = [-(-(max_model_len + self.draft_span + k + 1) // bs) for bs in block_sizes]

    def add_request(self, rid: int) -> Request:
        blocks = [[self.free[g].pop() for _ in range(w)] for g, w in enumerate(self.width_blocks)]
        req = Request(rid, blocks)
        self.requests[rid] = req
        return req

    def _rand_tokens(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (n,), generator=self.g)

    def call(self, plan: list[tuple[int, int, int]], padded: bool = True, temperatures=None) -> Call:
        """plan: (request id, query length, rejected count) per request, in batch order."""
        ids, positions, hidden, next_ids, qsl, seq_lens, rejected, sample = [], [], [], [], [0], [], [], []
        tables = [[] for _ in self.block_sizes]
        rows = []
        for rid, q, rej in plan:
            req = self.requests.get(rid) or self.add_request(rid)
            pos = torch.arange(req.next_pos, req.next_pos + q)
            assert int(pos[-1]) < self.max_model_len, "scenario ran past max_model_len"
            toks = self._rand_tokens(q)
            if req.next_pos > 0:
                toks[0] = req.pending_token
            h = torch.randn(q, self.width, generator=self.g).to(self.dtype)
            nxt = int(self._rand_tokens(1))
            sample_off = q - 1 - rej
            rows.append([pos, None, h, sample_off])
            ids.append(toks)
            positions.append(pos)
            hidden.append(h)
            next_ids.append(nxt)
            sample.append(qsl[-1] + sample_off)
            qsl.append(qsl[-1] + q)
            seq_lens.append(req.next_pos + q)
            rejected.append(rej)
            for g in range(len(self.block_sizes)):
                tables[g].append(req.blocks[g])
            req.next_pos = req.next_pos + q - rej  # the bonus token sits right after the last accepted one
            req.pending_token = nxt
        # The drafter shifts the flat batch by one, so a request's last row sees the next request's
        # first token (the batch's last row sees 0); only the sampled row gets the bonus token.
        flat = torch.cat(ids)
        shifted = torch.cat([flat[1:], torch.zeros(1, dtype=flat.dtype)])
        for r, row in enumerate(rows):
            start = qsl[r]
            mine = shifted[start: qsl[r + 1]].clone()
            mine[row[3]] = next_ids[r]
            row[1] = mine
        rows = [tuple(r) for r in rows]
        positions_t = torch.cat(positions)
        owner = torch.repeat_interleave(torch.arange(len(plan)), torch.tensor([p[1] for p in plan]))
        table_t = [torch.tensor(t, dtype=torch.int32) for t in tables]
        slots = [(table_t[g][owner, positions_t // bs].long() * bs + positions_t % bs)
                 for g, bs in enumerate(self.block_sizes)]
        any_rejected = any(rejected)
        kwargs = dict(
            target_token_ids=torch.cat(ids).to(torch.int32),
            target_positions=positions_t,
            target_hidden_states=torch.cat(hidden),
            next_token_ids=torch.tensor(next_ids, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=table_t,
            slot_mappings=slots,
        )
        if any_rejected:
            kwargs["num_rejected_tokens"] = torch.tensor(rejected, dtype=torch.int32)
            if padded:
                kwargs["token_indices_to_sample"] = torch.tensor(sample, dtype=torch.int32)
        if temperatures is not None:
            kwargs["temperatures"] = torch.tensor(temperatures, dtype=torch.float32)
        return Call(kwargs, [p[0] for p in plan], rows)
