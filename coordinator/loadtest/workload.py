"""Simulated target sessions: the propose calls one DP rank's target worker sends, step after step.

One SessionWorkload per session (= one DP rank; in a TP group only rank 0 sends, so TP does not
change what reaches the drafter).  Its model of a continuously batching target:

* The session has `max_num_seqs` request *slots*.  Slot i owns a fixed range of W blocks per KV
  group, [i*W, (i+1)*W) of the session's pool; a request holds its slot's blocks in a random order
  (block tables are not contiguous in a real engine either).  When a request finishes, the next
  one in that slot reuses the freed range, reshuffled.  Block tables and slot mappings therefore
  always lie inside the session's pool and agree with each other.
* Every step draws its batch size B from a distribution (1 <= B <= max_num_seqs) and schedules B
  slots picked at random.  A slot whose request finished starts a new one: prompt and output
  lengths are drawn from their own distributions.
* A request in prefill sends a chunk of its prompt (<= prefill_chunk tokens, within the step's
  max_num_batched_tokens budget; rejected 0).  A request in decode sends [bonus, k drafts] =
  k + 1 tokens with r rejected, where the number accepted is a run of Bernoulli(acceptance)
  successes (at most k), so its position advances by k + 1 - r.  Prefill chunks are therefore
  occasional (one or a few per request), decode steps the rule.
* Hidden states have the head's real width and synthetic values: one random buffer
  [max_num_batched_tokens, width] is made once and every call sends a leading slice of it (a view,
  no copy), so the generator is never the bottleneck.  Token ids are random.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from drafter.wire.tensors import DTYPES


class Dist:
    """An integer distribution from a short spec: fixed:N | uniform:LO:HI | normal:MEAN:STD |
    lognormal:MEDIAN:SIGMA.  Draws are rounded and clipped to [lo, hi] given at draw time."""

    KINDS = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2}

    def __init__(self, spec: str):
        kind, *args = str(spec).split(":")
        if kind not in self.KINDS or len(args) != self.KINDS[kind]:
            raise ValueError(f"bad distribution {spec!r}: use fixed:N, uniform:LO:HI, normal:MEAN:STD or "
                             "lognormal:MEDIAN:SIGMA")
        self.spec, self.kind = str(spec), kind
        try:
            self.args = tuple(float(a) for a in args)
        except ValueError:
            raise ValueError(f"bad distribution {spec!r}: numbers expected") from None
        if kind == "uniform" and self.args[0] > self.args[1]:
            raise ValueError(f"bad distribution {spec!r}: LO > HI")

    def draw(self, rng: np.random.Generator, lo: int, hi: int, size: int | None = None):
        a = self.args
        if self.kind == "fixed":
            x = np.full(size or 1, a[0])
        elif self.kind == "uniform":
            x = rng.integers(int(a[0]), int(a[1]) + 1, size or 1)
        elif self.kind == "normal":
            x = rng.normal(a[0], a[1], size or 1)
        else:
            x = a[0] * np.exp(rng.normal(0.0, a[1], size or 1))
        x = np.clip(np.rint(x), lo, hi).astype(np.int64)
        return x if size is not None else int(x[0])

    def __repr__(self) -> str:
        return self.spec


@dataclass(frozen=True)
class SessionShape:
    """What the drafter told us at attach time (Info / AttachResponse), in plain values."""

    hidden_width: int  # columns of target_hidden_states (hidden_size x aux layers for EAGLE-3)
    hidden_dtype: str  # wire dtype name, e.g. "bfloat16"
    vocab_size: int
    max_model_len: int
    block_sizes: tuple[int, ...]  # per KV group
    num_speculative_tokens: int  # k (chain), or the tree's depth
    draft_span: int  # positions past seq_len a draft step may write: k - 1, or the tree's nodes
    num_drafts: int  # columns of draft_token_ids: k, or the tree's nodes


@dataclass(frozen=True)
class WorkloadConfig:
    max_num_seqs: int = 64  # request slots of the session (its attach layout)
    max_num_batched_tokens: int = 2048  # token budget per step (its attach layout)
    batch: Dist = Dist("uniform:1:64")  # batch size per step
    prompt_len: Dist = Dist("lognormal:256:0.8")
    output_len: Dist = Dist("lognormal:192:0.7")
    prefill_chunk: int = 512  # most prompt tokens one request sends in one step
    acceptance: float = 0.7  # per-draft-token acceptance probability (sets the rejected counts)
    max_request_len: int = 0  # cap on a request's length (0: max_model_len); sizes the block ranges


def blocks_per_slot(shape: SessionShape, cfg: WorkloadConfig) -> tuple[int, ...]:
    """W per KV group: enough columns for the longest request plus what its draft steps may write."""
    horizon = min(request_capacity(shape, cfg) + shape.draft_span, shape.max_model_len)
    return tuple(-(-horizon // bs) for bs in shape.block_sizes)


def request_capacity(shape: SessionShape, cfg: WorkloadConfig) -> int:
    cap = shape.max_model_len if cfg.max_request_len <= 0 else min(cfg.max_request_len, shape.max_model_len)
    if cap < 2 * (shape.num_speculative_tokens + 1):
        raise ValueError(f"requests of at most {cap} tokens leave no room for a decode step of "
                         f"{shape.num_speculative_tokens + 1} tokens")
    return cap


def session_blocks(shape: SessionShape, cfg: WorkloadConfig) -> tuple[int, ...]:
    """The session's pool per KV group (what it attaches with): one block range per slot."""
    return tuple(cfg.max_num_seqs * w for w in blocks_per_slot(shape, cfg))


@dataclass
class Step:
    """One propose call and what the statistics need to know about it."""

    kwargs: dict  # DraftEngine.propose's tensors
    batch: int
    num_tokens: int
    prefills: int  # requests of this step sending a prompt chunk
    drafted: int  # draft tokens the call asks for: batch x num_drafts


class SessionWorkload:
    def __init__(self, shape: SessionShape, cfg: WorkloadConfig, seed: int = 0):
        self.shape, self.cfg = shape, cfg
        self.rng = np.random.default_rng(seed)
        self.k = shape.num_speculative_tokens
        self.cap = request_capacity(shape, cfg)
        m = cfg.max_num_seqs
        if cfg.max_num_batched_tokens < self.k + 1:
            raise ValueError(f"max_num_batched_tokens {cfg.max_num_batched_tokens} < one decode query ({self.k + 1})")
        # a step of decodes only must fit the token budget
        self.max_batch = min(m, cfg.max_num_batched_tokens // (self.k + 1))
        self.width = blocks_per_slot(shape, cfg)
        self.pos = np.zeros(m, np.int64)  # [slots] tokens of the request already sent (next position)
        self.prompt_left = np.zeros(m, np.int64)  # [slots]
        self.output_left = np.zeros(m, np.int64)  # [slots] 0 with prompt_left 0: finished / empty slot
        self.blocks = [np.zeros((m, w), np.int32) for w in self.width]  # per group [slots, W]
        self.requests_started = 0
        # [max_num_batched_tokens, width] synthetic hidden states, made once; calls send slices of it
        g = torch.Generator().manual_seed(seed)
        self.hidden = torch.randn(cfg.max_num_batched_tokens, shape.hidden_width, generator=g).to(
            DTYPES[shape.hidden_dtype])

    # ------------------------------------------------------------------ requests
    def _start(self, slot: int) -> None:
        decode = self.k + 1
        self.prompt_left[slot] = self.cfg.prompt_len.draw(self.rng, 1, self.cap - decode)
        self.output_left[slot] = self.cfg.output_len.draw(self.rng, 1, self.cap)
        self.pos[slot] = 0
        for g, w in enumerate(self.width):  # the slot's own range, in a fresh order
            self.blocks[g][slot] = slot * w + self.rng.permutation(w)
        self.requests_started += 1

    def _finished(self, slots: np.ndarray) -> np.ndarray:
        decoding = self.prompt_left[slots] == 0
        out_done = self.output_left[slots] <= 0
        full = self.pos[slots] + self.k + 1 > self.cap
        return decoding & (out_done | full)

    # ------------------------------------------------------------------ one step
    def step(self) -> Step:
        rng, k = self.rng, self.k
        b = self.cfg.batch.draw(rng, 1, self.max_batch)
        slots = np.sort(rng.permutation(self.cfg.max_num_seqs)[:b])  # b distinct slots
        for s in slots[self._finished(slots)]:
            self._start(int(s))
        prefill = self.prompt_left[slots] > 0  # [b]
        q = np.full(b, k + 1, np.int64)  # [b] query lengths
        budget = self.cfg.max_num_batched_tokens - int((~prefill).sum()) * (k + 1)
        keep = np.ones(b, bool)
        for i in np.flatnonzero(prefill):  # few: prefill chunks share what decode queries leave
            c = int(min(self.prompt_left[slots[i]], self.cfg.prefill_chunk, budget))
            keep[i] = c > 0
            q[i] = c
            budget -= max(c, 0)
        if not keep.all():
            slots, prefill, q = slots[keep], prefill[keep], q[keep]
            b = len(slots)
        rejected = np.zeros(b, np.int64)  # [b]
        dec = np.flatnonzero(~prefill)
        if len(dec):
            ok = rng.random((len(dec), k)) < self.cfg.acceptance  # [decodes, k]
            rejected[dec] = k - np.cumprod(ok, axis=1).sum(axis=1)
        qsl = np.zeros(b + 1, np.int64)  # [b + 1]
        np.cumsum(q, out=qsl[1:])
        n = int(qsl[-1])
        owner = np.repeat(np.arange(b), q)  # [n] request of each token
        start = self.pos[slots]  # [b]
        positions = start[owner] + np.arange(n) - qsl[:-1][owner]  # [n]
        tables = [blk[slots] for blk in self.blocks]  # per group [b, W]
        slot_maps = [t[owner, positions // bs].astype(np.int64) * bs + positions % bs
                     for t, bs in zip(tables, self.shape.block_sizes)]  # per group [n]
        vocab = self.shape.vocab_size
        kwargs = dict(
            target_token_ids=torch.from_numpy(rng.integers(0, vocab, n, dtype=np.int32)),  # [n]
            target_positions=torch.from_numpy(positions),  # [n]
            target_hidden_states=self.hidden[:n],  # [n, width] a view of the shared buffer
            next_token_ids=torch.from_numpy(rng.integers(0, vocab, b, dtype=np.int32)),  # [b]
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)),  # [b + 1]
            seq_lens=torch.from_numpy((start + q).astype(np.int32)),  # [b]
            block_tables=[torch.from_numpy(t) for t in tables],
            slot_mappings=[torch.from_numpy(s) for s in slot_maps],
        )
        if rejected.any():  # the padded drafter batch: rejected tokens stay, sampling skips them
            kwargs["num_rejected_tokens"] = torch.from_numpy(rejected.astype(np.int32))  # [b]
            kwargs["token_indices_to_sample"] = torch.from_numpy((qsl[1:] - 1 - rejected).astype(np.int32))  # [b]
        # advance: prefill consumed its chunk; decode emitted accepted drafts + the bonus token
        self.pos[slots] += q - rejected
        self.prompt_left[slots[prefill]] -= q[prefill]
        self.output_left[slots[~prefill]] -= q[~prefill] - rejected[~prefill]
        return Step(kwargs, b, n, int(prefill.sum()), b * self.shape.num_drafts)
