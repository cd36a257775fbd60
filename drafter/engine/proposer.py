"""The speculative drafting algorithm over padded static buffers.

Notation for one request: the target verified tokens up to position p (p = the position of the
last accepted token) and sampled the bonus token x_{p+1}.  The head predicts token t+1 from
(token t, target hidden state at t-1), so the first pass feeds each query row the *next*
token beside its hidden state and samples at p:

    d_1     = sample(head(x_{p+1}, h_p))                       first pass, over all query rows
    d_{i+1} = sample(head(d_i, g_i)) at position p + i        chain step i = 1 .. k-1

where g_i is the head's own hidden output for the previous step.  A step whose position
reaches max_model_len writes nothing (slot -1), is fed position 0 and sees one key (seq_len 1):
its draft is garbage the target ignores, and the shapes stay fixed.  A tree replaces the
chain by top-k children per node; each node attends to the context plus its ancestors.

An MTP head is told which of its layers a step runs through the head's step argument: chain step
(or tree level) s under the per_step schedule, always 0 under first_layer (vLLM 0.32's V1 runner:
MTP layer 0 at every step; docs/vllm-0.32-proposer.md, section 14).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter.attention.metadata import PADDING_SLOT_ID, AttentionMetadata
from drafter.engine.buffers import StaticBuffers
from drafter.engine.sampling import sample_drafts


@dataclass
class Drafts:
    token_ids: torch.Tensor  # [batch_padded, k] (chain) or [batch_padded, num_tree_nodes] (tree), int64
    probs: torch.Tensor | None  # [batch_padded, k, vocab] float32, only when asked
    logits: torch.Tensor | None = None  # [batch_padded, k, head_vocab], only when asked (debugging, parity)


class Proposer:
    def __init__(self, head, kv_caches: list[torch.Tensor], backend, num_speculative_tokens: int,
                 max_model_len: int, token_tree: tuple[tuple[int, ...], ...] | None,
                 mtp_layer_schedule: str = "per_step"):
        self.head = head
        # the head's step index per draft step: first_layer pins every step to layer 0
        self.first_layer_only = mtp_layer_schedule == "first_layer"
        self.kv_caches = kv_caches
        self.backend = backend
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.tree = token_tree
        device = kv_caches[0].device if kv_caches else torch.device("cpu")
        self._levels = _tree_levels(token_tree, device) if token_tree else {}

    def first_pass(self, buf: StaticBuffers, num_tokens: int, batch: int):
        """Run the head over every query row; return the sampled rows' outputs."""
        logit_h, carry_h = self.first_pass_all_rows(buf, num_tokens, batch)
        rows = buf.sample_indices[:batch]
        return logit_h[rows], carry_h[rows], buf.positions[rows]  # [batch, H], [batch, H], [batch]

    def first_pass_all_rows(self, buf: StaticBuffers, num_tokens: int, batch: int):
        """The head over every query row: (logit hidden, carried hidden), each [num_tokens, H]."""
        hidden = self.head.combine_hidden_states(buf.hidden[:num_tokens])
        return self.head(buf.input_ids[:num_tokens], buf.positions[:num_tokens], hidden, self.kv_caches,
                         buf.first_pass_metadata(num_tokens, batch), self.backend, step=0)

    def head_step(self, step: int) -> int:
        """The step index the head is given for draft step `step` (picks an MTP head's layer)."""
        return 0 if self.first_layer_only else step

    def _sample(self, hidden, carry, step, temps, generator, want_probs, want_logits=True):
        """(draft ids, probs, logits, the next step's layer input or None).  A fused head may do
        argmax + d2t in one launch (greedy_draft), or also build the next step's layer input in it
        (greedy_next_inputs) when a step follows."""
        at = self.head_step(step)
        if temps is None and not want_probs and not want_logits:
            next_inputs = getattr(self.head, "greedy_next_inputs", None)
            if next_inputs is not None and step + 1 < self.k:
                ids, layer_input = next_inputs(hidden, carry, at)
                return ids, None, None, layer_input
            greedy = getattr(self.head, "greedy_draft", None)
            if greedy is not None:
                return greedy(hidden, at), None, None, None
        logits = self.head.compute_logits(hidden, at)
        ids, probs = sample_drafts(logits, temps, generator, want_probs)
        return self.head.draft_to_target(ids), probs, logits, None

    def _step_metadata(self, buf: StaticBuffers, batch: int, positions: torch.Tensor, live: torch.Tensor):
        """Metadata for one token per row at `positions` (already clamped); dead rows write nothing."""
        metas = []
        for g, bs in enumerate(buf.block_sizes):
            table = buf.block_tables[g][:batch]
            block = table.gather(1, (positions // bs)[:, None]).squeeze(1).long()
            slots = torch.where(live, block * bs + positions % bs, PADDING_SLOT_ID)
            metas.append(AttentionMetadata(
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=positions.device),
                seq_lens=None, block_table=table, slot_mapping=slots, block_size=bs))
        return metas

    def chain(self, buf: StaticBuffers, batch: int, num_real: int, first, temps, generator, want_probs,
              want_logits: bool = False) -> Drafts:
        logit_h, carry_h, pos = first
        # padded rows carry seq_len 0 in the buffers; reading that (not num_real) keeps the loop
        # free of host values, so one captured graph serves every num_real
        real = buf.seq_lens[:batch] > 0
        ids, probs, logits, layer_input = self._sample(logit_h, carry_h, 0, temps, generator, want_probs,
                                                       want_logits)
        drafts, all_probs, all_logits = [ids], [probs], [logits]
        step_inputs = self._chain_step_inputs(buf, batch, pos, real)
        for step in range(1, self.k):
            pos, fed_pos, metas = step_inputs[step - 1]
            prepared = {} if layer_input is None else {"layer_input": layer_input}
            logit_h, carry_h = self.head(ids, fed_pos, carry_h, self.kv_caches, metas, self.backend,
                                         step=self.head_step(step), **prepared)
            ids, probs, logits, layer_input = self._sample(logit_h, carry_h, step, temps, generator, want_probs,
                                                           want_logits)
            drafts.append(ids)
            all_probs.append(probs)
            all_logits.append(logits)
        stacked = torch.stack(all_probs, dim=1) if want_probs else None
        return Drafts(torch.stack(drafts, dim=1), stacked, torch.stack(all_logits, dim=1) if want_logits else None)

    def _chain_step_inputs(self, buf: StaticBuffers, batch: int, pos: torch.Tensor, real: torch.Tensor):
        """Per chain step 1 .. k-1: (its position, the position fed to the head, metadata per KV
        group).  A backend may do all steps in one launch (TritonBackend.decode_step_inputs)."""
        if self.k == 1:
            return []
        fused = getattr(self.backend, "decode_step_inputs", None)
        if fused is not None:
            return fused(pos, buf.seq_lens[:batch], [t[:batch] for t in buf.block_tables], buf.block_sizes,
                         self.max_model_len, self.k - 1)
        out = []
        for _ in range(1, self.k):
            out.append(self._next_step_inputs(buf, batch, pos, real))
            pos = out[-1][0]
        return out

    def _next_step_inputs(self, buf: StaticBuffers, batch: int, pos: torch.Tensor, real: torch.Tensor):
        """(position + 1, the position fed to the head, metadata per KV group) for the next step."""
        pos = pos + 1
        exceeds = pos >= self.max_model_len
        fed_pos = torch.where(exceeds, 0, pos)
        seq_lens = torch.where(exceeds, 1, pos + 1).masked_fill(~real, 0).to(torch.int32)
        metas = self._step_metadata(buf, batch, fed_pos, real & ~exceeds)
        for m in metas:
            m.seq_lens = seq_lens
        return pos, fed_pos, metas

    def tree_drafts(self, buf: StaticBuffers, batch: int, num_real: int, first) -> Drafts:
        """Greedy tree: the children of a node are its top-m tokens, m = its child count in the tree."""
        logit_h, carry_h, base = first
        tree = self.tree
        device = base.device
        depth = max(len(p) for p in tree)
        index = {p: i for i, p in enumerate(tree)}
        tokens = torch.zeros(batch, len(tree), dtype=torch.long, device=device)
        # a row whose tree would pass max_model_len is dead: it reads and writes nothing (padded rows
        # have seq_len 0: reading the buffer, not num_real, keeps the loop free of host values)
        live = (buf.seq_lens[:batch] > 0) & (base + 1 + len(tree) <= self.max_model_len)
        parents_logits = {(): self.head.compute_logits(logit_h, 0)}
        parents_hidden = {(): carry_h}
        for level in range(1, depth + 1):
            level_paths = [p for p in tree if len(p) == level]
            for p in level_paths:
                top = parents_logits[p[:-1]].topk(p[-1] + 1, dim=-1).indices[:, p[-1]]
                tokens[:, index[p]] = self.head.draft_to_target(top)
            if level == depth:
                break
            parents_logits, parents_hidden = self._tree_level(buf, batch, live, base, level, level_paths, tokens,
                                                              parents_hidden, index)
        return Drafts(tokens, None)

    def _tree_level(self, buf, batch, live, base, level, level_paths, tokens, parents_hidden, index):
        """Forward the nodes of one level at once: node i of the flattened tree sits at logical
        index base + 1 + i (its KV slot), is fed rope position base + level, and sees the context
        plus its ancestors."""
        n_level = len(level_paths)
        mask, flat, depths = self._levels[level]
        n_seen = depths.shape[0]  # nodes whose KV exists after this level
        logical = base[:, None] + 1 + flat[None, :]  # [batch, n_level]
        logical = torch.where(live[:, None], logical, 0)
        fed_pos = torch.where(live, base + level, 0)[:, None].expand(batch, n_level).reshape(-1)
        ids = tokens[:, flat].reshape(-1)
        hidden = torch.stack([parents_hidden[p[:-1]] for p in level_paths], dim=1).reshape(batch * n_level, -1)
        seq_lens = torch.where(live, base + 1 + n_seen, 0).to(torch.int32)
        metas = []
        for g, bs in enumerate(buf.block_sizes):
            table = buf.block_tables[g][:batch]
            block = table.gather(1, logical // bs).long()
            slots = torch.where(live[:, None], block * bs + logical % bs, PADDING_SLOT_ID).reshape(-1)
            metas.append(AttentionMetadata(
                query_start_loc=torch.arange(0, batch * n_level + 1, n_level, dtype=torch.int32, device=base.device),
                seq_lens=seq_lens, block_table=table, slot_mapping=slots, block_size=bs, tree_mask=mask,
                tree_depths=depths))
        at = self.head_step(level)
        logit_h, carry_h = self.head(ids, fed_pos, hidden, self.kv_caches, metas, self.backend, step=at)
        logits = self.head.compute_logits(logit_h, at).view(batch, n_level, -1)
        carry_h = carry_h.view(batch, n_level, -1)
        return ({p: logits[:, j] for j, p in enumerate(level_paths)},
                {p: carry_h[:, j] for j, p in enumerate(level_paths)})


def _tree_levels(tree, device) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per tree level, built once as device tensors (a draft loop inside a CUDA graph cannot copy
    from the host): the level's ancestor mask over the nodes seen so far [n_level, n_seen] bool,
    the level's flat node indices [n_level], and the depths of the seen nodes [n_seen]."""
    index = {p: i for i, p in enumerate(tree)}
    levels = {}
    for level in range(1, max(len(p) for p in tree) + 1):
        level_paths = [p for p in tree if len(p) == level]
        seen = [p for p in tree if len(p) <= level]
        mask = torch.tensor([[q == p[: len(q)] for q in seen] for p in level_paths], device=device)
        flat = torch.tensor([index[p] for p in level_paths], device=device)
        depths = torch.tensor([len(p) for p in seen], device=device)
        levels[level] = (mask, flat, depths)
    return levels
