"""Pre-drafting: draft the next step for the likeliest verification outcomes, before verification.

Notation for one request, as in proposer.py: the call drafted d_1..d_k from its last accepted row
at position p (token x_{p+1}, target hidden state h_p).  The target will accept a of the drafts
and sample b after them; the next call would then draft from the target's hidden states
H_{p+1}..H_{p+1+a}.  Those do not exist yet, so a pre-draft uses the head's own:

    trunk   g_0 = combine(h_p);  (logits_s, g_{s+1}) = head(t_s, g_s) at position p + s,
            t_0 = x_{p+1}, t_s = d_s,  s = 0 .. k           (logits_s ranks the token at p + s + 2)
    rank    log P(a, b) = sum_{i < a} log q_i(d_{i+1}) + log q_a(b),  b != d_{a+1} when a < k;
            keep the `outcomes` likeliest (a, b) per request (q_s = softmax(logits_s))
    branch  e_1 = argmax head(b, g_{a+1}) at position p + a + 1, then e_2 .. e_k' chained

All requests' branches run as one batch through the head's own forward and attention backend.
Every key written goes to scratch blocks past the pool's session blocks: a branch sees the
context's real KV below p, the trunk's keys for p .. p + a, and its own keys after that (the
block where it diverges is copied first), so the session's KV is never written and branches
never see each other.  Verification decides what is kept, so output is unchanged whatever the
pre-drafts are; how often they are right is what decides whether this pays.

    pre = predraft(engine, inputs, drafts, step)   # after engine.draft(inputs) returned `drafts`
    finish = predraft_queued(engine, inputs, drafts, step)   # the GPU work queued, nothing waited for
    pre = finish()                                           # later (another lock, another thread): the result
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from drafter.attention.metadata import PADDING_SLOT_ID, AttentionMetadata
from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.wire.predraft import PreDrafts
from drafter.wire.records import ProposeInputs

PREDRAFT_METHODS = ("eagle", "eagle3")


def _span_blocks(block_size: int, positions: int) -> int:
    """Blocks that `positions` consecutive positions can touch, wherever they start in a block."""
    return -(-(block_size - 1 + positions) // block_size)


@dataclass(frozen=True)
class ScratchLayout:
    """Where one group's scratch blocks sit: after the session blocks, per batch row the trunk's
    blocks, then each outcome's."""

    base: int  # first scratch block id (the configured num_blocks)
    trunk: int  # blocks per row's trunk (positions p .. p + max(k, k'))
    branch: int  # blocks per outcome (positions p + a + 1 .. p + a + k')
    outcomes: int

    @property
    def per_row(self) -> int:
        return self.trunk + self.outcomes * self.branch


def trunk_width(config: EngineConfig) -> int:
    """Drafts a pre-draft's trunk runs along: max(k, k').  After a hit on a deeper pre-draft the
    target verifies k' drafts, so the next call's pre-draft is conditioned on k' of them; after an
    exact step on k, padded with -1 to this width (those positions rank no outcome)."""
    return max(config.num_speculative_tokens, config.predraft_k)


def scratch_layouts(config: EngineConfig) -> tuple[ScratchLayout, ...]:
    """Per KV group, the scratch pre-drafting needs (none when it is off)."""
    b = config.predraft_outcomes
    return tuple(ScratchLayout(g.num_blocks, _span_blocks(g.block_size, trunk_width(config) + 1) if b else 0,
                               _span_blocks(g.block_size, config.predraft_k) if b else 0, b)
                 for g in config.kv_groups)


def pool_groups(config: EngineConfig) -> tuple[KVGroupSpec, ...]:
    """The KV pool's groups: the configured blocks plus max_num_seqs rows of scratch."""
    return tuple(KVGroupSpec(g.block_size, g.num_blocks + config.max_num_seqs * s.per_row)
                 for g, s in zip(config.kv_groups, scratch_layouts(config)))


# --------------------------------------------------------------------------- the algorithm
def predraft(engine, inp: ProposeInputs,
             drafts: torch.Tensor,  # [batch, k] int: the drafts the target will verify for this call
             step: int, outcomes: int | None = None) -> PreDrafts:
    """The next step's drafts for each request's `outcomes` likeliest outcomes (module docstring;
    default and most: config.predraft_outcomes, which sized the scratch).  The call's own draft
    must have run first: the context's KV below p is read from the pool."""
    return predraft_queued(engine, inp, drafts, step, outcomes)()


@torch.inference_mode()
def predraft_queued(engine, inp: ProposeInputs,
                    drafts: torch.Tensor,  # [batch, k] int: the drafts the target will verify for this call
                    step: int, outcomes: int | None = None):
    """predraft() with its GPU work queued and its outputs' copies to the host queued behind it,
    nothing waited for: returns finish() -> PreDrafts, which waits for those copies alone.  A
    caller that holds the engine's lock queues under it and finishes after releasing it (a bound
    session's pre-draft: the host never waits for the GPU under the lock).  On a CPU engine the
    work is done before this returns."""
    cfg = engine.config
    # where the call's tensors are (a server's: the host); the graphs stage them into their buffers
    # without a host wait, the eager path moves them to the device
    rows = _drafted_rows(inp, inp.target_hidden_states.device)
    drafts = pad_drafts(drafts.to(rows.positions.device, torch.long), trunk_width(cfg))
    budget = min(outcomes or cfg.predraft_outcomes, cfg.predraft_outcomes)
    graphs = graphs_of(engine)
    out = graphs.run(rows, drafts, inp.block_tables) if graphs is not None else None
    if out is None:  # no graphs, or a batch or table above what they were captured for
        dev = engine.device
        on_dev = _Rows(rows.positions.to(dev), rows.next_tokens.to(dev), rows.hidden.to(dev))
        live = torch.ones_like(on_dev.positions, dtype=torch.bool)
        out = _compute(engine, on_dev, drafts.to(dev), [t.to(dev, torch.long) for t in inp.block_tables], live,
                       cfg.predraft_outcomes)
    # the outcomes are ranked: a smaller budget keeps the likeliest (graphs always compute the most)
    accepted, tokens, branch, log_probs = (t[:, :budget] for t in out)
    parts = [inp.block_tables[0][:, 0].long(), rows.positions.long(), drafts.long(), accepted, tokens, branch,
             log_probs.float()]
    host, done = to_host(parts)

    def finish() -> PreDrafts:
        if done is not None:
            done.synchronize()
        return PreDrafts(step, *host)
    return finish


def pad_drafts(drafts: torch.Tensor,  # [batch, j] int64, j <= width; -1 = no draft
               width: int) -> torch.Tensor:  # [batch, width] int64
    """The drafts verified, padded with -1 to the trunk's width (trunk_width).  A -1 is no draft:
    the trunk runs past it on scratch keys, and no outcome accepts it (rank_outcomes)."""
    if drafts.shape[1] > width:
        raise ValueError(f"{drafts.shape[1]} drafts verified; pre-drafts condition on at most {width}")
    if drafts.shape[1] == width:
        return drafts
    pad = drafts.new_full((drafts.shape[0], width - drafts.shape[1]), -1)
    return torch.cat([drafts, pad], 1)


def to_host(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], "torch.cuda.Event | None"]:
    """Copies of `parts` on the host: for GPU tensors, pinned buffers filled by copies queued on the
    current stream, and the event after them (wait on it before reading); else plain clones."""
    host, event, device = [], None, None
    for t in parts:
        if t.device.type == "cuda":
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)  # on the current stream of t's device
            host.append(h)
            device = t.device
        else:
            host.append(t.clone())
    if device is not None:  # after the copies on that stream, whichever device this thread has current
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
    return host, event


def _compute(engine, rows: "_Rows", drafts: torch.Tensor,  # [rows, k] int64
             tables: list[torch.Tensor],  # per group [rows, width] int64
             live: torch.Tensor,  # [rows] bool: padded rows write and read nothing
             budget: int) -> tuple[torch.Tensor, ...]:
    """The algorithm on device tensors, no host read: (accepted [rows, budget], b [rows, budget],
    drafts [rows, budget, k'], joint log-probability [rows, budget]); the eager path and the
    graphs run it alike."""
    cfg, head = engine.config, engine.head
    layouts = scratch_layouts(cfg)
    trunk_tables = _fork(engine, tables, layouts, rows.positions, [s.trunk for s in layouts],
                         lambda s, r: s.base + r * s.per_row)  # r: [rows] batch rows
    logits, carries = _trunk(engine, rows, drafts, trunk_tables, live)
    accepted, tokens, log_probs = rank_outcomes(logits, drafts, head, budget)
    batch, n_out = accepted.shape
    owner = torch.arange(batch, device=engine.device).repeat_interleave(n_out)  # [batch * outcomes]
    a = accepted.reshape(-1).clamp(min=0)
    start = rows.positions[owner] + 1 + a  # the branch's first position, p + a + 1
    branch_tables = _fork(engine, [t[owner] for t in trunk_tables], layouts, start, [s.branch for s in layouts],
                          lambda s, r: s.base + (r // n_out) * s.per_row + s.trunk + (r % n_out) * s.branch)
    hidden = carries[owner, a]  # g_{a+1}: the head's own state after d_a
    branch = _chain(engine, tokens.reshape(-1), hidden, start, branch_tables, cfg.predraft_k,
                    live=(accepted.reshape(-1) >= 0) & live[owner])
    return accepted, tokens, branch.view(batch, n_out, -1), log_probs


def rank_outcomes(logits: torch.Tensor,  # [batch, k + 1, head vocab]: the trunk's logits_0 .. logits_k
                  drafts: torch.Tensor,  # [batch, k] int64 target ids
                  head, budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `budget` likeliest outcomes per row under the head: (a [batch, budget] int64, -1 where
    fewer exist; b [batch, budget] int64 target ids; joint log-probability [batch, budget]).  A
    draft of -1 (pad_drafts) is none: no outcome accepts it or anything after it."""
    batch, k1, vocab = logits.shape
    logq = torch.log_softmax(logits.float(), dim=-1)
    n = min(budget + 1, vocab)  # one spare per position: the rejected draft is not a candidate
    top_lp, top_ids = logq.topk(n, dim=-1)
    top_tok = head.draft_to_target(top_ids)  # [batch, k + 1, n]
    # [batch, k] head ids, -1 = outside its vocab or no draft (a -1 pad: no outcome accepts it)
    own = _target_to_draft(head, vocab, logits.device)[drafts.clamp(min=0)].masked_fill(drafts < 0, -1)
    lp_d = logq[:, :-1].gather(-1, own.clamp(min=0)[..., None]).squeeze(-1).masked_fill(own < 0, float("-inf"))
    prefix = torch.cat([lp_d.new_zeros(batch, 1), lp_d.cumsum(1)], 1)  # [batch, k + 1]: log P(d_1..d_a)
    rejected = torch.cat([drafts, drafts.new_full((batch, 1), -1)], 1)  # d_{a+1}, none after all k
    score = (prefix[..., None] + top_lp).masked_fill(top_tok == rejected[..., None], float("-inf"))
    best = score.view(batch, -1).topk(min(budget, k1 * n), dim=-1)
    accepted = torch.where(best.values > float("-inf"), best.indices // n, -1)
    return accepted, top_tok.view(batch, -1).gather(1, best.indices), best.values


# --------------------------------------------------------------------------- the pieces
@dataclass(frozen=True)
class _Rows:
    positions: torch.Tensor  # [batch] int64: p
    next_tokens: torch.Tensor  # [batch] int64: x_{p+1}
    hidden: torch.Tensor  # [batch, hidden input width]: h_p


def _drafted_rows(inp: ProposeInputs, device) -> _Rows:
    """Each request's drafted-from row, chosen as buffers.load chooses it."""
    sample = inp.token_indices_to_sample
    if sample is None:
        sample = inp.query_start_loc[1:] - 1
        if inp.num_rejected_tokens is not None:
            sample = sample - inp.num_rejected_tokens
    sample = sample.to(inp.target_positions.device, torch.long)
    return _Rows(inp.target_positions[sample].to(device, torch.long), inp.next_token_ids.to(device, torch.long),
                 inp.target_hidden_states[sample.to(inp.target_hidden_states.device)].to(device))


class _HostStage:
    """Host buffers (pinned on a GPU host) beside each static input buffer of the graphs: a call's
    host tensors are written there and reach the GPU by one asynchronous copy per buffer, queued
    on the current stream ahead of the replay.  Pageable copies instead (`.to(device)` of the
    call's tensors) each wait on the host (a cudaMemcpy from pageable memory synchronises), and in
    `drafter serve` the pre-draft's few such copies took ~5 ms in all (measured on two H200s,
    bench/results/2026-11-26-h200x2-predraft-stages; the replay itself 2.2 ms).  A buffer is
    rewritten only by the next call, after this call's outputs were read (a host wait on the
    stream that ran these copies)."""

    def __init__(self, like: list[torch.Tensor], pin: bool):
        self.host = [torch.zeros(t.shape, dtype=t.dtype, pin_memory=pin) for t in like]

    def put(self, i: int, dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
        """dst[:rows] = src (rows of it; columns past src's zero), through host buffer i."""
        h = self.host[i][:rows]
        if src.dim() == 2 and src.shape[1] < h.shape[1]:
            h.zero_()
            h[:, : src.shape[1]].copy_(src)
        else:
            h.copy_(src)
        dst[:rows].copy_(h, non_blocking=True)


def _target_to_draft(head, vocab: int, device) -> torch.Tensor:  # [target vocab] int64, -1 = not drafted
    ids = torch.arange(vocab, device=device)
    target = head.draft_to_target(ids)
    out = torch.full((head.spec.vocab_size,), -1, dtype=torch.long, device=device)
    out[target] = ids
    return out


def _fork(engine, tables: list[torch.Tensor],  # per group [rows, width] int64
          layouts, start: torch.Tensor,  # [rows] int64: the first position the fork writes
          blocks: list[int], base_of) -> list[torch.Tensor]:
    """Block tables that share `tables` below `start` and own scratch blocks from start's block on:
    that block's keys are copied in first, the later ones are new."""
    out = []
    for g, (table, layout, n) in enumerate(zip(tables, layouts, blocks)):
        bs = engine.config.kv_groups[g].block_size
        rows = table.shape[0]
        width = table.shape[1] + n
        forked = torch.zeros(rows, width, dtype=torch.long, device=table.device)
        forked[:, : table.shape[1]] = table
        first = (start // bs).clamp(max=table.shape[1] - 1)  # [rows]
        base = base_of(layout, torch.arange(rows, device=table.device))  # [rows] the first own block
        cols = first[:, None] + torch.arange(n, device=table.device)[None, :]  # [rows, n]
        own = base[:, None] + torch.arange(n, device=table.device)[None, :]
        _copy_blocks(engine, g, table.gather(1, first[:, None]).squeeze(1), base)
        forked.scatter_(1, cols, own)
        out.append(forked)
    return out


def _copy_blocks(engine, group: int, src: torch.Tensor, dst: torch.Tensor) -> None:  # [n] block ids each
    for cache, g in zip(engine.kv.layers, engine.kv.kv_group_of_layer):
        if g == group:
            cache.index_copy_(1, dst, cache.index_select(1, src))


def _step(engine, ids: torch.Tensor,  # [rows] int64
          positions: torch.Tensor,  # [rows] int64
          hidden: torch.Tensor,  # [rows, H]: the head's hidden input
          tables: list[torch.Tensor],  # per group [rows, width] int64
          step: int, live: torch.Tensor  # [rows] bool
          ) -> tuple[torch.Tensor, torch.Tensor]:  # (logit hidden, carried hidden), each [rows, H]
    """One token per row through the head; a position past max_model_len writes and reads nothing
    useful (as in the chain: position 0, one key, slot -1)."""
    rows = ids.shape[0]
    exceeds = positions >= engine.config.max_model_len
    fed = torch.where(exceeds, 0, positions)
    write = live & ~exceeds
    seq_lens = torch.where(exceeds, 1, fed + 1).masked_fill(~live, 0).to(torch.int32)
    metas = []
    for g, table in enumerate(tables):
        bs = engine.config.kv_groups[g].block_size
        block = table.gather(1, (fed // bs)[:, None]).squeeze(1)
        metas.append(AttentionMetadata(
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=ids.device), seq_lens=seq_lens,
            block_table=table.to(torch.int32), slot_mapping=torch.where(write, block * bs + fed % bs, PADDING_SLOT_ID),
            block_size=bs))
    return engine.head(ids, fed, hidden, engine.kv.layers, metas, engine.backend, step=step)


def _trunk(engine, rows: _Rows, drafts: torch.Tensor,  # [batch, k]
           tables: list[torch.Tensor], live: torch.Tensor  # [batch] bool
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The head along the call's own drafts: logits_0..logits_k [batch, k + 1, head vocab] and the
    carried states g_1..g_{k+1} [batch, k + 1, H]."""
    head = engine.head
    hidden = head.combine_hidden_states(rows.hidden)
    tokens = torch.cat([rows.next_tokens[:, None], drafts.clamp(min=0)], 1)  # a -1 pad runs as token 0
    logits, carries = [], []
    for s in range(drafts.shape[1] + 1):
        logit_h, hidden = _step(engine, tokens[:, s], rows.positions + s, hidden, tables, s, live)
        logits.append(head.compute_logits(logit_h, s))
        carries.append(hidden)
    return torch.stack(logits, 1), torch.stack(carries, 1)


def _chain(engine, tokens: torch.Tensor,  # [rows] int64: b
           hidden: torch.Tensor,  # [rows, H]: g_{a+1}
           start: torch.Tensor,  # [rows] int64: p + a + 1
           tables: list[torch.Tensor], k: int, live: torch.Tensor  # [rows] bool
           ) -> torch.Tensor:  # [rows, k] int64 greedy drafts
    """A greedy chain of k drafts per row, as the proposer chains them."""
    head = engine.head
    out = []
    for s in range(k):
        logit_h, hidden = _step(engine, tokens, start + s, hidden, tables, s, live)
        tokens = head.draft_to_target(head.compute_logits(logit_h, s).argmax(-1))
        out.append(tokens)
    return torch.stack(out, 1)


# --------------------------------------------------------------------------- the GPU path: graphs
def graphs_of(engine) -> "PreDraftGraphs | None":
    """The engine's pre-draft graphs, captured at the first pre-draft (None without draft graphs,
    or when capture failed: the eager path then serves every call)."""
    runner = getattr(engine, "graphs", None)
    if runner is None or not hasattr(runner, "capture_extra"):
        return None
    graphs = getattr(engine, "_predraft_graphs", None)
    if graphs is None:
        graphs = PreDraftGraphs(engine, runner)
        log = logging.getLogger("drafter.engine.predraft")
        try:
            graphs.capture()
            log.info("pre-draft graphs captured", extra={"event": "predraft_graphs", "sizes": sorted(graphs.replays)})
        except Exception:  # noqa: BLE001 - the eager path computes the same pre-drafts
            log.exception("pre-draft graphs not captured: pre-drafts run eagerly")
            graphs.sizes = []
        engine._predraft_graphs = graphs
    return graphs


class PreDraftGraphs:
    """All outcomes x requests of one call in one replay: per batch capture size, one graph of
    trunk, ranking and branches (`_compute`) over static buffers; a batch pads to a capture size,
    its padded rows live=False (they write and read no KV of anyone's: slot -1, seq_len 0; their
    forks write only their own rows' scratch).  Captured into the draft graphs' pool on their
    private stream (GraphRunner.capture_extra); emulated on CPU as the runner emulates."""

    def __init__(self, engine, runner):
        cfg = engine.config
        self.engine, self.runner = engine, runner
        self.sizes = [b for b in cfg.capture_sizes if b <= cfg.max_num_seqs]
        m, dev, n = max(self.sizes, default=0), engine.device, cfg.predraft_outcomes
        self.positions = torch.zeros(m, dtype=torch.long, device=dev)  # [max batch]
        self.next_tokens = torch.zeros(m, dtype=torch.long, device=dev)  # [max batch]
        self.hidden = torch.zeros(m, engine.spec.hidden_input_width, dtype=cfg.torch_dtype, device=dev)  # [max batch, W]
        self.drafts = torch.zeros(m, trunk_width(cfg), dtype=torch.long, device=dev)  # [max batch, max(k, k')]
        self.live = torch.zeros(m, dtype=torch.bool, device=dev)  # [max batch]
        self.tables = [torch.zeros(m, w, dtype=torch.long, device=dev) for w in cfg.max_blocks_per_req]
        self.out = (torch.full((m, n), -1, dtype=torch.long, device=dev),  # accepted [max batch, B]
                    torch.zeros(m, n, dtype=torch.long, device=dev),  # b [max batch, B]
                    torch.zeros(m, n, cfg.predraft_k, dtype=torch.long, device=dev),  # drafts [max batch, B, k']
                    torch.zeros(m, n, dtype=torch.float32, device=dev))  # log-probability [max batch, B]
        self.replays: dict[int, object] = {}
        self.count = 0  # calls answered by a replay
        # host inputs go through host buffers (pinned on a GPU): no host wait before the replay
        self.stage = _HostStage([self.positions, self.next_tokens, self.hidden, self.drafts, *self.tables],
                                pin=dev.type == "cuda") if m else None

    def capture(self) -> None:
        for b in sorted(self.sizes, reverse=True):
            self.replays[b] = self.runner.capture_extra(lambda b=b: self._step(b))

    def _step(self, b: int) -> None:
        rows = _Rows(self.positions[:b], self.next_tokens[:b], self.hidden[:b])
        got = _compute(self.engine, rows, self.drafts[:b], [t[:b] for t in self.tables], self.live[:b],
                       self.engine.config.predraft_outcomes)
        for dst, src in zip(self.out, got):
            dst[:b].copy_(src)

    def run(self, rows: _Rows, drafts: torch.Tensor,  # [batch, k] int64
            tables: list[torch.Tensor]) -> tuple[torch.Tensor, ...] | None:  # per group [batch, width]
        """The four outputs for the real rows (views of the static outputs: read them before the
        next replay), or None when no graph fits this call.  Inputs on the host (a server's) go
        through the host stage, inputs on the device are copied device to device."""
        batch = rows.positions.shape[0]
        fits = [b for b in self.sizes if b >= batch]
        if not fits or any(t.shape[1] > s.shape[1] for t, s in zip(tables, self.tables)):
            return None
        b = min(fits)
        host = rows.positions.device.type == "cpu" and self.stage is not None
        with torch.inference_mode():
            pairs = [(self.positions, rows.positions), (self.next_tokens, rows.next_tokens), (self.hidden, rows.hidden),
                     (self.drafts, drafts), *zip(self.tables, tables)]
            for i, (dst, src) in enumerate(pairs):
                if host:
                    self.stage.put(i, dst, src, batch)
                elif src.dim() == 2 and src.shape[1] < dst.shape[1]:  # a block table narrower than the graph's
                    dst[:batch].zero_()
                    dst[:batch, : src.shape[1]].copy_(src)
                else:
                    dst[:batch].copy_(src)
                dst[batch:b].zero_()
            self.live[:batch].fill_(True)
            self.live[batch:b].fill_(False)
            self.replays[b]()
        self.count += 1
        return tuple(t[:batch] for t in self.out)
