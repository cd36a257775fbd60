"""Build the drafter call from a target step, and apply its answer: vLLM's proposer inputs.

For each request that will decode again, the call carries its rows [frontier, seq_len): the
rows the drafter has not seen yet (normally exactly this step's query; more after a failed call
or a drafter restart), with the target's hidden states, the next (sampled) token, and the
padded-batch rejection bookkeeping: seq_lens count rejected rows, token_indices_to_sample
points at each request's last accepted row, num_rejected_tokens tells the drafter (and its
acceptance metrics) how many of the previous drafts the target rejected.  Shifting ids by one
is the drafter's job.

Every TP rank builds the same call from the same state, and `apply` moves every rank's
frontiers the same way (rank 0 shares the outcome), so ranks > 0 mirror rank 0 without talking
to the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coordinator.session import DraftResult, SessionSpec
from coordinator.target.request import Request
from drafter.engine.config import KVGroupSpec


@dataclass
class DraftCall:
    kwargs: dict  # the propose() keywords, tensors on CPU
    requests: list[Request]  # batch order
    new_frontiers: list[int]  # where each request's frontier moves if the call succeeds
    # [batch] int: drafts accepted last step, -1 = no report (the drafter's acceptance metrics)
    accepted_counts: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return int(self.kwargs["target_token_ids"].shape[0]) if self.requests else 0


EMPTY_CALL = DraftCall({}, [], [])


def session_spec(*, method: str, k: int, hidden_size: int, num_aux_layers: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, block_size: int, num_blocks: int,
                 num_kv_groups: int, dtype: str = "float32", client: str = "") -> SessionSpec:
    """The session a target worker attaches: every drafter KV group mirrors its block-id space."""
    return SessionSpec(method=method, num_speculative_tokens=k, hidden_size=hidden_size,
                       num_aux_layers=num_aux_layers, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens,
                       kv_groups=tuple(KVGroupSpec(block_size, num_blocks) for _ in range(num_kv_groups)),
                       dtype=dtype, client=client)


class CallBuilder:
    def __init__(self, *, k: int, max_model_len: int, block_size: int, blocks_per_req: int,
                 num_kv_groups: int, max_num_batched_tokens: int):
        self.k = k
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.blocks_per_req = blocks_per_req
        self.num_kv_groups = num_kv_groups
        self.max_tokens = max_num_batched_tokens
        self.generation: int | None = None

    def wants_drafts(self, req: Request) -> bool:
        """Drafts help only if the next step may verify at least one of them."""
        nxt = req.last.query_start + req.last.last_accepted_row + 1
        return not req.finished and req.remaining >= 2 and nxt + 1 < self.max_model_len

    def build(self, requests: list[Request]) -> DraftCall:
        ids, positions, hidden, next_ids, qsl, seq_lens, tables, slots, sample, rejected, accepted = (
            [], [], [], [], [0], [], [], [], [], [], [])
        chosen, frontiers = [], []
        for req in requests:
            if req.last is None or not self.wants_drafts(req):
                continue
            last = req.last
            f = min(req.frontier, last.query_start)
            rows = last.seq_len - f
            if qsl[-1] + rows > self.max_tokens:
                continue  # over the session's token budget: no drafts this step, catches up later
            pos = torch.arange(f, last.seq_len)
            ids.append(torch.tensor(req.tokens[f:last.query_start] + last.query, dtype=torch.int32))
            positions.append(pos)
            hidden.append(req.hidden[f:last.seq_len])
            next_ids.append(last.next_token)
            sample.append(qsl[-1] + (last.query_start - f) + last.last_accepted_row)
            qsl.append(qsl[-1] + rows)
            seq_lens.append(last.seq_len)
            rejected.append(last.num_rejected)
            accepted.append(last.accepted_report)
            table = torch.zeros(self.blocks_per_req, dtype=torch.int32)
            table[: len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)
            tables.append(table)
            slots.append(table[pos // self.block_size].long() * self.block_size + pos % self.block_size)
            chosen.append(req)
            frontiers.append(last.query_start + last.last_accepted_row + 1)
        if not chosen:
            return EMPTY_CALL
        table = torch.stack(tables)
        slot = torch.cat(slots)
        kwargs = dict(
            target_token_ids=torch.cat(ids),
            target_positions=torch.cat(positions),
            target_hidden_states=torch.cat(hidden),
            next_token_ids=torch.tensor(next_ids, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            # every KV group of the drafter mirrors the target's one block-id space
            block_tables=[table] * self.num_kv_groups,
            slot_mappings=[slot] * self.num_kv_groups,
            token_indices_to_sample=torch.tensor(sample, dtype=torch.int32),
            num_rejected_tokens=torch.tensor(rejected, dtype=torch.int32),
        )
        return DraftCall(kwargs, chosen, frontiers, torch.tensor(accepted, dtype=torch.int32))

    def apply(self, call: DraftCall, result: DraftResult, requests: list[Request]) -> bool:
        """Hand out drafts and move frontiers; returns True when the drafts were used."""
        for req in requests:
            req.drafts = []
        changed = result.generation != self.generation
        fresh = changed and self.generation is not None
        self.generation = result.generation
        if changed and (fresh or result.drafts is None):
            # a new session (restart, re-attach, fail-over) holds no KV for anyone: resend all
            for req in requests:
                req.frontier = 0
            if fresh:
                return False
        if result.drafts is None or not call.requests:
            return False
        for req, row, frontier in zip(call.requests, result.drafts.tolist(), call.new_frontiers):
            req.drafts = row
            req.frontier = frontier
        return True
