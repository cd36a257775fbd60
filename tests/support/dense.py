"""A dense reference drafter: no KV cache, every draft recomputed from the full history.

It keeps, per request and per "unit" (the whole head for EAGLE, each MTP layer for MTP),
the latest (input token, hidden) written at each position, and answers every query by
running the head over that whole history with plain masked attention.  Positions a unit
never wrote count as zero keys and values, as in a freshly zeroed paged pool.
"""

from __future__ import annotations

import torch

from drafter.models.heads import MTPHead


class DenseBackend:
    """Attention over exactly the tokens passed in, under an explicit mask."""

    def __init__(self, mask: torch.Tensor, written: torch.Tensor):
        self.mask = mask  # [L, L] bool, query x key
        self.written = written  # [L] bool: keys with content (others are zero K/V)

    def forward(self, q, k, v, kv_cache, meta, sliding_window=None):
        w = self.written[:, None, None].to(k.dtype)
        k, v = k * w, v * w
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1).float()
        v = v.repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * q.shape[-1] ** -0.5
        mask = self.mask.clone()
        if sliding_window is not None:
            idx = torch.arange(mask.shape[0])
            mask &= idx[None, :] > idx[:, None] - sliding_window
        probs = torch.nan_to_num(torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1))
        return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


class DenseReference:
    def __init__(self, head, k: int, max_model_len: int):
        self.head = head
        self.k = k
        self.max_model_len = max_model_len
        self.logs: dict[tuple[int, int], dict[int, tuple[int, torch.Tensor]]] = {}
        self.num_units = len(head.layers) if isinstance(head, MTPHead) else 1
        self.last_logits: list[torch.Tensor] = []  # per request of every call: [k, head_vocab]

    def _unit(self, step: int) -> int:
        return step % self.num_units

    def _run(self, rid: int, unit: int, step: int, query_pos: int, query_tok: int, query_h: torch.Tensor,
             write: bool):
        """Head output (logit hidden, carry hidden) for one query, recomputed over the whole history."""
        log = self.logs.setdefault((rid, unit), {})
        if write:
            log[query_pos] = (query_tok, query_h)
            length = query_pos + 1
            toks = torch.tensor([log[p][0] if p in log else 0 for p in range(length)])
            hid = torch.stack([log[p][1] if p in log else torch.zeros_like(query_h) for p in range(length)])
            written = torch.tensor([p in log for p in range(length)])
            positions = torch.arange(length)
            mask = torch.ones(length, length, dtype=torch.bool).tril()
        else:  # past max_model_len: fed position 0, sees only the key stored at position 0
            toks = torch.tensor([log[0][0] if 0 in log else 0, query_tok])
            hid = torch.stack([log[0][1] if 0 in log else torch.zeros_like(query_h), query_h])
            written = torch.tensor([0 in log, False])
            positions = torch.zeros(2, dtype=torch.long)
            mask = torch.tensor([[True, False], [True, False]])
        backend = DenseBackend(mask, written)
        caches = [None] * len(self.head.layers)
        metas = [None, None]
        logit_h, carry_h = self.head(toks, positions, hid, caches, metas, backend, step=step)
        return logit_h[-1], carry_h[-1]

    @torch.inference_mode()
    def propose(self, call, padded: bool = True) -> torch.Tensor:  # [batch, k]
        out = []
        for rid, (pos, shifted, hidden, sample_off) in zip(call.request_ids, call.rows):
            hidden = self.head.combine_hidden_states(hidden)
            unit0 = self._unit(0)
            q = len(pos) if padded else sample_off + 1
            for j in range(q):  # the first pass writes every (kept) query row
                self.logs.setdefault((rid, unit0), {})[int(pos[j])] = (int(shifted[j]), hidden[j])
            logit_h, carry_h = self._run(rid, unit0, 0, int(pos[sample_off]), int(shifted[sample_off]),
                                         hidden[sample_off], write=True)
            ids, logits = [self._sample(logit_h, 0)], [self.head.compute_logits(logit_h[None], 0)[0]]
            p = int(pos[sample_off])
            for step in range(1, self.k):
                p += 1
                live = p < self.max_model_len
                logit_h, carry_h = self._run(rid, self._unit(step), step, p, ids[-1], carry_h, write=live)
                ids.append(self._sample(logit_h, step))
                logits.append(self.head.compute_logits(logit_h[None], step)[0])
            out.append(ids)
            self.last_logits.append(torch.stack(logits))
        return torch.tensor(out)

    def _sample(self, logit_h: torch.Tensor, step: int) -> int:
        logits = self.head.compute_logits(logit_h[None], step)
        return int(self.head.draft_to_target(logits.argmax(-1))[0])

    @torch.inference_mode()
    def propose_tree(self, call, tree) -> torch.Tensor:  # [batch, num_nodes]
        """Each node's output recomputed over context + its ancestors; children = top-m of the parent."""
        out = []
        for rid, (pos, shifted, hidden, sample_off) in zip(call.request_ids, call.rows):
            hidden = self.head.combine_hidden_states(hidden)
            log = self.logs.setdefault((rid, 0), {})
            for j in range(len(pos)):
                log[int(pos[j])] = (int(shifted[j]), hidden[j])
            base = int(pos[sample_off])
            context = [log[p] for p in range(base + 1)]
            logit_h, carry_h = self._sequence(context, [], 0)
            outputs = {(): (self.head.compute_logits(logit_h[None], 0)[0], carry_h)}
            tokens = {}
            for path in tree:
                parent_logits, parent_h = outputs[path[:-1]]
                top = parent_logits.topk(path[-1] + 1).indices[path[-1]]
                tokens[path] = int(self.head.draft_to_target(top[None])[0])
                chain = [(tokens[path[:i]], outputs[path[:i - 1]][1]) for i in range(1, len(path) + 1)]
                logit_h, carry_h = self._sequence(context, chain, len(path))
                outputs[path] = (self.head.compute_logits(logit_h[None], len(path))[0], carry_h)
            out.append([tokens[p] for p in tree])
        return torch.tensor(out)

    def _sequence(self, context, chain, step):
        entries = context + chain
        n = len(entries)
        toks = torch.tensor([t for t, _ in entries])
        hid = torch.stack([h for _, h in entries])
        backend = DenseBackend(torch.ones(n, n, dtype=torch.bool).tril(), torch.ones(n, dtype=torch.bool))
        logit_h, carry_h = self.head(toks, torch.arange(n), hid, [None] * len(self.head.layers), [None, None],
                                     backend, step=step)
        return logit_h[-1], carry_h[-1]
