"""Pre-drafting measured against a simulated target: target tokens/s, not a model of them.

    python -m coordinator.bench.predraft_target --out DIR [--target-device cuda:0 --drafter-device cuda:1]
    python -m coordinator.bench.predraft_target --out DIR --tiny --target-device cpu --drafter-device cpu

The target is simulated; everything else is the real code.  Each step the target runs its
"verification": GPU work of exactly V ms on its own device (torch.cuda._sleep calibrated to V;
on a CPU, a spin of V ms), then draws each row's accepted length a from the acceptance per
position (--acceptance; the last value repeats for deeper positions; rows whose drafts were a
pre-draft accept with those values scaled so that tokens per step are --predraft-factor of the
exact drafts'), and builds the next propose call (vLLM's padded-batch layout: the row's k + 1
query tokens, the rejected ones counted, the next token b, the accepted counts) with EAGLE-3
hidden states kept on its device.  Three ways to get drafts for it:

  in-process     a DraftEngine on the target's device, called after verification (validate=False)
  exact remote   `drafter serve` on --drafter-device, the call over ZMQ (hidden states copied to
                 the host and sent as bytes), the target waiting for the reply
  exact bound    the same server through the product's bound client (cuda_ipc: the call copied
                 into a slab on the target's GPU, a header-only step; what a RemoteProposer runs
                 once bound), the target waiting; these steps ask for no pre-drafts
  pre-draft      the same server with --predraft-outcomes B: it pushes the next step's drafts for
                 the likeliest outcomes while the target verifies; the target picks locally
                 (coordinator.predraft.PreDraftPicker) and, when every row hits, sends the call
                 without waiting; otherwise it waits for the exact drafts as above
  (predraft_nowait: the same, but a step whose rows mostly hit goes without waiting, its missed
                 rows verifying no drafts)
  bound pre-draft the exact bound session asking for pre-drafts (predraft_bound): the drafter
                 pushes each set on the binding's doorbell after the StepDone; the target picks
                 locally (coordinator.predraft.BoundPreDrafting) and, when every row hits, sends
                 the header without waiting (step_nowait); otherwise the exact bound step

Where each step's time goes: the target stamps each timed step (verify end, outcome drawn, call
built, sent, drafts in hand) and the served drafter (`python -m drafter.tools.bench.predraft
serve`) writes every call's stage marks (read, engine, reply sent, pre-draft, push) as JSON lines;
both use perf_counter_ns (CLOCK_MONOTONIC, one host), so each run's row carries per-stage p50s
(STAGES) and the .md a table of them.

Which b the target samples cannot come from random weights, so it is drawn: with probability
--hit-by-a / --hit-all (the hit rates measured on the trained pair, by a) the row's outcome is one
the pushed set predicted (the predicted outcome with the drawn a when there is one, else the
set's likeliest: the row's tokens still count a + 1, the call carries the predicted outcome),
otherwise b is a token no pre-draft predicted.  A set that is not at the target when its
verification ends is a miss for every row, whatever was drawn.  Measured per (V, batch, k, mode):
tokens/s = emitted tokens (a + 1 per row and step) over wall time, steps, hit rate.  Writes
predraft_target.json and predraft_target.md (the table with these assumptions beside it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from coordinator.predraft import PickerStats, PreDraftPicker
from drafter.wire.predraft import merge
from drafter.wire.records import ProposeInputs, ProposeRequest

BLOCK_SIZE = 16
STEP_BASE = 1_000_000  # each session's call ids start at a multiple of it
MODES = ("in_process", "exact_remote", "predraft")  # the default runs; also "predraft_nowait"


# --------------------------------------------------------------------------- assumptions
@dataclass(frozen=True)
class Assumptions:
    """What the simulated target draws; defaults are the CPU measurements of docs/predraft.md
    (trained pair, k = 3, B = 4)."""

    acceptance: tuple[float, ...] = (0.85, 0.81, 0.76)  # conditional, per draft position
    hit_by_a: tuple[float, ...] = (0.5, 0.57, 0.8)  # P(outcome predicted | a < k accepted); last repeats
    hit_all: float = 0.94  # P(outcome predicted | all k accepted)
    predraft_factor: float = 0.935  # tokens per step of pre-drafts over exact drafts, same steps

    def alpha(self, i: int) -> float:  # i = 1 .. k
        return self.acceptance[min(i, len(self.acceptance)) - 1]

    def tau(self, k: int, scale: float = 1.0) -> float:
        """Expected tokens per step with k drafts, every alpha times scale."""
        total, alive = 1.0, 1.0
        for i in range(1, k + 1):
            alive *= min(1.0, self.alpha(i) * scale)
            total += alive
        return total

    def predraft_scale(self, k: int) -> float:
        """The alpha scale c with tau(k, c) = predraft_factor * tau(k) (bisection)."""
        goal, lo, hi = self.predraft_factor * self.tau(k), 0.0, 1.0 / max(self.acceptance)
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.tau(k, mid) < goal else (lo, mid)
        return (lo + hi) / 2

    def hit(self, a: int, k: int) -> float:
        return self.hit_all if a == k else self.hit_by_a[min(a, len(self.hit_by_a) - 1)]


# --------------------------------------------------------------------------- the verify
class Verify:
    """Exactly `ms` of work on the target's device per step: a calibrated GPU sleep kernel on its
    current stream, or a host spin on a CPU."""

    def __init__(self, device: torch.device, ms: float):
        self.device, self.ms = device, ms
        self.cycles = int(ms * self._cycles_per_ms()) if device.type == "cuda" else 0
        self._end = 0.0

    def _cycles_per_ms(self) -> float:
        with torch.cuda.device(self.device):
            torch.cuda._sleep(1_000_000)  # warm the kernel
            rates = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(20_000_000)
                end.record()
                end.synchronize()
                rates.append(20_000_000 / start.elapsed_time(end))
            return statistics.median(rates)

    def launch(self) -> None:
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda._sleep(self.cycles)
        else:
            self._end = time.perf_counter() + self.ms / 1e3

    def wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        else:
            while time.perf_counter() < self._end:
                pass


# --------------------------------------------------------------------------- the target's rows
@dataclass
class SimConfig:
    batch: int
    k: int
    ctx: int  # context length at the first call
    max_len: int  # positions the rows may reach
    vocab: int
    width: int  # the hidden states' width (3 x hidden for EAGLE-3)
    seed: int = 0
    predraft_k: int = 0  # k': drafts a row verifies when they are a (deeper) pre-draft; 0 = k

    @property
    def span(self) -> int:
        """The most drafts a row verifies: max(k, k')."""
        return max(self.k, self.predraft_k)


class Rows:
    """The target's batch: per row the drafted-from position p, x_{p+1}, and the drafts it will
    verify (k exact drafts, k' when they are a deeper pre-draft, none); builds each step's propose
    call from the outcome it draws."""

    def __init__(self, cfg: SimConfig, device: torch.device, dtype: torch.dtype, assume: Assumptions):
        self.cfg, self.assume = cfg, assume
        self.gen = torch.Generator().manual_seed(cfg.seed)
        per_req = -(-cfg.max_len // BLOCK_SIZE)
        self.tables = torch.arange(cfg.batch * per_req, dtype=torch.int32).view(cfg.batch, per_req)
        self.hidden = torch.randn(cfg.batch * (cfg.span + 1), cfg.width, generator=self.gen).to(device, dtype)
        self.p = torch.full((cfg.batch,), cfg.ctx - cfg.k - 2, dtype=torch.long)  # before the first call
        self.x = self._tokens(cfg.batch)
        self.drafts = torch.full((cfg.batch, cfg.span), -1, dtype=torch.long)  # [batch, max(k, k')], -1: none
        self.drafts[:, : cfg.k] = self._tokens(cfg.batch * cfg.k).view(cfg.batch, cfg.k)
        self.pre = torch.zeros(cfg.batch, dtype=torch.bool)  # rows whose drafts are a pre-draft
        self.ndraft = torch.full((cfg.batch,), cfg.k, dtype=torch.long)  # drafts each row verifies: k, k', or 0
        self.scales = {n: assume.predraft_scale(n) for n in {cfg.k, cfg.span}}  # a pre-draft's alphas, by length
        self.tokens = 0
        self.pre_rows, self.pre_tokens = 0, 0  # rows that verified a pre-draft, and the tokens they emitted

    def _tokens(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.cfg.vocab, (n,), generator=self.gen)

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.gen))

    def draw_accepted(self) -> list[int]:
        """Each row's accepted length, from the acceptance (scaled for pre-drafted rows)."""
        out = []
        for r in range(self.cfg.batch):
            n = int(self.ndraft[r])
            pre = bool(self.pre[r]) and n > 0
            scale = self.scales.get(n) or self.assume.predraft_scale(n) if pre else 1.0
            a = 0
            while a < n and self.uniform() < min(1.0, self.assume.alpha(a + 1) * scale):
                a += 1
            if pre:
                self.pre_rows, self.pre_tokens = self.pre_rows + 1, self.pre_tokens + a + 1
            out.append(a)
        return out

    def call(self, accepted: list[int] | None, next_tokens: torch.Tensor, hidden: torch.Tensor,
             ) -> tuple[dict, torch.Tensor | None]:
        """The propose keywords for outcome (accepted, next_tokens) of the drafts in self.drafts;
        accepted None: the first call (all k + 1 tokens are context).  Returns (keywords, the
        accepted counts to report or None) and moves every row on to its new drafted-from row."""
        b, k, w = self.cfg.batch, self.cfg.k, self.cfg.span
        n = self.ndraft if accepted is not None else torch.full((b,), k, dtype=torch.long)  # [b] drafts verified
        a = torch.tensor(accepted if accepted is not None else [k] * b, dtype=torch.long)
        q = n + 1  # [b] query tokens per row: x_{p+1} and the drafts it verified
        full = self.p[:, None] + 1 + torch.arange(w + 1)[None, :]  # [b, w + 1]
        keep = torch.arange(w + 1)[None, :] < q[:, None]  # [b, w + 1]
        positions = full[keep]  # [tokens], row after row
        ids = torch.cat([self.x[:, None], self.drafts.clamp(min=0)], 1)[keep]  # [tokens]
        owner = torch.arange(b).repeat_interleave(q)  # [tokens]
        slots = self.tables.long()[owner, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        qsl = torch.zeros(b + 1, dtype=torch.int32)
        qsl[1:] = q.cumsum(0)
        kw = dict(target_token_ids=ids, target_positions=positions,
                  target_hidden_states=hidden[: positions.shape[0]], next_token_ids=next_tokens.clone(),
                  query_start_loc=qsl, seq_lens=(self.p + 1 + q).to(torch.int32), block_tables=[self.tables],
                  slot_mappings=[slots], num_rejected_tokens=(n - a).to(torch.int32))
        self.p = self.p + 1 + a
        self.x = next_tokens.clone()
        return kw, (a if accepted is not None else None)

    def set_drafts(self, drafts: torch.Tensor, pre: list[bool]) -> None:  # [batch, <= max(k, k')] int64, -1: none
        """The drafts each row verifies next: its drafts up to the first -1 (a row of -1 verifies none,
        an exact row padded to a deeper pre-draft's width verifies k)."""
        got = drafts.to("cpu", torch.long)[:, : self.cfg.span]
        self.drafts = torch.full((got.shape[0], self.cfg.span), -1, dtype=torch.long)
        self.drafts[:, : got.shape[1]] = got
        self.pre = torch.tensor(pre, dtype=torch.bool)
        self.ndraft = (self.drafts >= 0).long().cumprod(1).sum(1)


# --------------------------------------------------------------------------- three ways to draft
class InProcess:
    """A DraftEngine on the target's device, called on its critical path."""

    name = "in_process"

    def __init__(self, engine):
        self.engine = engine
        self.steps = 0
        self.device = engine.device
        self.sent_ns, self.waited = 0, True  # the last call: when it left for the drafter, whether the target waited

    def hidden(self, rows: Rows) -> torch.Tensor:
        return rows.hidden

    def outcomes(self, rows: Rows, accepted: list[int], stats: dict) -> tuple[list[int], torch.Tensor]:
        return accepted, rows._tokens(rows.cfg.batch)

    def draft(self, step: int, kw: dict, accepted_counts) -> tuple[torch.Tensor, list[bool]]:
        self.sent_ns = time.perf_counter_ns()
        dev = {n: ([t.to(self.device, non_blocking=True) for t in v] if isinstance(v, list)
                   else v.to(self.device, non_blocking=True)) for n, v in kw.items()}
        drafts = self.engine.propose(**dev, validate=False).draft_token_ids.cpu()
        return drafts, [False] * drafts.shape[0]

    def close(self) -> None:
        pass


class ExactRemote:
    """A served drafter over ZMQ; the target waits for every reply."""

    name = "exact_remote"

    def __init__(self, client):
        self.client = client
        self.steps = 0
        self.sent_ns, self.waited = 0, True

    def hidden(self, rows: Rows) -> torch.Tensor:
        return rows.hidden.cpu()  # the target's device -> the host, as a bytes transport needs

    def outcomes(self, rows: Rows, accepted: list[int], stats: dict) -> tuple[list[int], torch.Tensor]:
        return accepted, rows._tokens(rows.cfg.batch)

    def request(self, step: int, kw: dict, accepted_counts, want: bool) -> ProposeRequest:
        return ProposeRequest(ProposeInputs(**{n: kw.get(n) for n in ProposeInputs.__dataclass_fields__}),
                              accepted_counts, request_id=step, want_predrafts=want)

    def draft(self, step: int, kw: dict, accepted_counts) -> tuple[torch.Tensor, list[bool]]:
        request = self.request(step, kw, accepted_counts, False)
        self.sent_ns = time.perf_counter_ns()
        drafts = self.client.request_drafts(request).draft_token_ids
        return drafts, [False] * drafts.shape[0]

    def close(self) -> None:
        self.client.detach()


class PreDraft(ExactRemote):
    """The served drafter pushing pre-drafts; the target picks locally once verification ends."""

    name = "predraft"

    def __init__(self, client):
        super().__init__(client)
        self.picker = PreDraftPicker()
        client.on_push = self.picker.offer
        self.last_step = 0
        self.unawaited = 0
        self.late_wait_s = 0.5  # long enough for any pre-draft here; 0 once sets stop coming
        self.missing = 0

    def outcomes(self, rows: Rows, accepted: list[int], stats: dict) -> tuple[list[int], torch.Tensor]:
        """b per row: one the arrived set predicted with probability hit(a), else one it did not."""
        self.client.poll_pushes(0.0)
        pre = self.picker.pending.get(self.last_step)
        if pre is None and self.last_step:
            stats["not_arrived"] += 1
            pre = self._late_set()
        elif pre is not None:
            self.missing, self.late_wait_s = 0, 0.5
        if pre is not None and not bool((pre.accepted >= 0).any()):
            stats["empty"] += 1  # the drafter made none this time (its budget is 0)
        sent, tokens = [], rows._tokens(rows.cfg.batch)
        # Python lists once per step: this runs between the verify and the call (the critical path)
        index = {} if pre is None else pre.index()
        acc, nxt = ([], []) if pre is None else (pre.accepted.tolist(), pre.next_tokens.tolist())
        firsts, ps, drafts, ndraft = (rows.tables[:, 0].tolist(), rows.p.tolist(), rows.drafts.tolist(),
                                      rows.ndraft.tolist())
        for r, a in enumerate(accepted):
            got = index.get((firsts[r], ps[r]))
            bare = ndraft[r] == 0  # verified no drafts: only a = 0 outcomes can match
            n = ndraft[r]
            ok = got is not None and (bare or (len(got[1]) >= n and list(got[1][:n]) == drafts[r][:n]))
            row = got[0] if got is not None else None
            valid = [] if not ok else [i for i in range(len(acc[row])) if acc[row][i] >= 0
                                       and (not bare or acc[row][i] == 0)]
            if valid and rows.uniform() < rows.assume.hit(a, n or rows.cfg.k):
                same = [i for i in valid if acc[row][i] == a]
                i = same[0] if same else valid[0]
                stats["remapped"] += int(not same)
                sent.append(acc[row][i])
                tokens[r] = nxt[row][i]
                continue
            predicted = set() if not ok else {nxt[row][i] for i in valid if acc[row][i] == a}
            while int(tokens[r]) in predicted:
                tokens[r] = (tokens[r] + 1) % rows.cfg.vocab
            sent.append(a)
        return sent, tokens

    def _late_set(self):
        """The set verification ended without: waited for only to draw b as the real target's b
        would fall (predicted or not), never picked from (dropped as late).  The wait overlaps the
        drafter's pre-draft, which the next call would queue behind anyway; the drafter pushes an
        empty set when it makes none, so this never waits in vain."""
        self.client.poll_pushes(self.late_wait_s, until=lambda: self.picker.has(self.last_step))
        pre = self.picker.pending.pop(self.last_step, None)
        if pre is not None:
            self.picker.stats.late += 1
            self.missing, self.late_wait_s = 0, 0.5
        else:  # a drafter that pushes nothing at all (an old one, or failing): stop waiting for it
            self.missing += 1
            if self.missing >= 3:
                self.late_wait_s = 0.0
        return pre

    def draft(self, step: int, kw: dict, accepted_counts) -> tuple[torch.Tensor, list[bool]]:
        request = self.request(step, kw, accepted_counts, True)
        hits = self.picker.pick(step, request.inputs, request.accepted_counts)
        self.last_step = step
        self.sent_ns, self.waited = time.perf_counter_ns(), False
        if hits and all(h is not None for h in hits) and self.client.send_nowait(request):
            self.unawaited += 1
            return torch.stack(hits), [True] * len(hits)
        self.waited = True
        exact = self.client.request_drafts(request).draft_token_ids
        return merge(exact, hits)


class PreDraftNoWait(PreDraft):
    """PreDraft, but a step whose rows mostly hit (at least `min_hits` of them) goes out without
    waiting either: the rows that missed verify no drafts this step (one token each) instead of
    making every row wait for the exact drafts.  Lossless all the same: any drafts, none included."""

    name = "predraft_nowait"
    min_hits = 0.5

    def draft(self, step: int, kw: dict, accepted_counts) -> tuple[torch.Tensor, list[bool]]:
        request = self.request(step, kw, accepted_counts, True)
        hits = self.picker.pick(step, request.inputs, request.accepted_counts)
        self.last_step = step
        got = [h is not None for h in hits]
        self.sent_ns, self.waited = time.perf_counter_ns(), False
        if hits and sum(got) >= max(1, self.min_hits * len(hits)) and self.client.send_nowait(request):
            self.unawaited += 1
            width = max((int(h.shape[0]) for h in hits if h is not None), default=1)
            drafts = torch.full((len(hits), width), -1, dtype=torch.long)
            for r, h in enumerate(hits):
                if h is not None:
                    drafts[r, : h.shape[0]] = h
            return drafts, got
        self.waited = True
        return merge(self.client.request_drafts(request).draft_token_ids, hits)


class ExactBound:
    """What a user's RemoteProposer runs once its session is bound (BoundConfig plane "auto"): the
    product's bound client (coordinator.transport.bound_ipc.CudaIpcBoundClient) over cuda_ipc
    between two GPUs of one host (the host ring on a CPU), the call's tensors copied into the
    session's slab on the target's device by the product's fill, a header-only step, the target
    waiting for the drafts.  Its steps ask for no pre-drafts (predraft_bound's do), so this is exact
    remote drafting at the bound path's cost."""

    name = "exact_bound"

    def __init__(self, client):
        self.client = client
        self.steps = 0
        self.sent_ns, self.waited = 0, True
        self.last_stamps: dict = {}  # the last step's stamps of the bound client (both sides' perf_counter_ns)

    def hidden(self, rows: Rows) -> torch.Tensor:
        return rows.hidden  # stays on the target's device: fill copies it into the slab there

    def outcomes(self, rows: Rows, accepted: list[int], stats: dict) -> tuple[list[int], torch.Tensor]:
        return accepted, rows._tokens(rows.cfg.batch)

    def draft(self, step: int, kw: dict, accepted_counts) -> tuple[torch.Tensor, list[bool]]:
        from coordinator.transport.bound_transport import fill

        self.sent_ns = time.perf_counter_ns()
        n, b = fill(self.client.views, ProposeInputs(**{f: kw.get(f) for f in ProposeInputs.__dataclass_fields__}))
        drafts = self.client.step(n, b)
        self.last_stamps = dict(self.client.stamps)
        return drafts, [False] * b

    def close(self) -> None:
        try:
            self.client.detach()
        finally:
            self.client.close()


class PreDraftBound(PreDraft):
    """Pushed pre-drafts on the bound session (cuda_ipc): each step asks for them; the drafter
    pushes each set on the binding's channel after the StepDone; the target picks locally and,
    when every row hits, sends the step's header without waiting for its reply (no round trip),
    else takes the exact bound step (coordinator.predraft.BoundPreDrafting).  Outcomes are drawn
    as for `predraft` (PreDraft.outcomes), keyed by the binding's step numbers."""

    name = "predraft_bound"

    def __init__(self, client):
        from coordinator.predraft import BoundPreDrafting

        self.client = client
        self.steps = 0
        self.sent_ns, self.waited = 0, True
        self.pd = BoundPreDrafting(client)
        self.picker = self.pd.picker
        self.unawaited = 0
        self.late_wait_s = 0.5
        self.missing = 0
        self.last_stamps: dict = {}

    @property
    def last_step(self) -> int:  # the binding's last step: the key of the set the next pick reads
        return self.client.last_step

    def hidden(self, rows: Rows) -> torch.Tensor:
        return rows.hidden  # on the target's device: the slab is filled there

    def draft(self, step: int, kw: dict, accepted_counts) -> tuple[torch.Tensor, list[bool]]:
        inputs = ProposeInputs(**{f: kw.get(f) for f in ProposeInputs.__dataclass_fields__})
        self.sent_ns = time.perf_counter_ns()
        before = self.pd.unawaited
        drafts, pre = self.pd.step(inputs, accepted_counts)
        self.waited = self.pd.unawaited == before
        self.unawaited += int(not self.waited)
        self.last_stamps = dict(self.client.stamps) if self.waited else {}
        self.last_pd = dict(self.pd.stamps)  # poll / pick / settle / fill (/ sent) on this side
        self.last_bstep = self.client.last_step  # the binding's step: the key of the drafter's pre-draft marks
        return drafts, pre

    def close(self) -> None:
        try:
            self.client.settle()
            self.client.detach()
        finally:
            self.client.close()


class PreDraftBoundNoWait(PreDraftBound):
    """predraft_bound, but a step whose rows mostly hit (at least half) goes without waiting too:
    the rows that missed verify no drafts this step (BoundPreDrafting's min_hits)."""

    name = "predraft_bound_nowait"

    def __init__(self, client):
        super().__init__(client)
        self.pd.min_hits = 0.5


class PreDraftBoundEarly(PreDraftBound):
    """predraft_bound as before the TAKEN word: the drafter's pre-draft after an awaited step starts
    at once, beside the target's read of that step's drafts (BoundPreDrafting(signal_taken=False))."""

    name = "predraft_bound_early"

    def __init__(self, client):
        super().__init__(client)
        self.pd.signal_taken = False


def bound_client(endpoint: str, batch: int, k: int, args, span: int = 0):
    """A bound session of the product's client for the bench's calls (plane: cuda_ipc where the
    drafter can read the target's GPU, else the host ring)."""
    from types import SimpleNamespace

    from coordinator.transport.bound_ipc import CudaIpcBoundClient
    from coordinator.transport.bound_transport import session_buffers

    layout = attach_request(endpoint, batch, args)
    spec = SimpleNamespace(num_speculative_tokens=k, hidden_width=layout.hidden_size * max(1, layout.num_aux_layers),
                           dtype="bfloat16", kv_groups=layout.kv_groups, max_model_len=layout.max_model_len)
    # a step after hits on deeper pre-drafts carries k' + 1 tokens a row (span = max(k, k'))
    tokens = batch * (max(k, span) + 1)
    buffers = session_buffers(spec, SimpleNamespace(max_num_seqs=batch, max_num_batched_tokens=tokens),
                              0, 0, 0)
    client = CudaIpcBoundClient(endpoint, layout, buffers, max_batch=batch, device=args.target_device, timeout_s=20,
                                transport="ipc" if endpoint.startswith("ipc://") else "tcp")
    try:
        plane = client.bind()
    except BaseException:
        client.close()
        raise
    print(f"  bound b={batch} k={k}: plane {plane} {client.fallback_reason}".rstrip(), flush=True)
    return client


def run(rows: Rows, drafter, verify: Verify, steps: int, warmup: int) -> dict:
    """The target loop: verify, draw the outcome, build the call, get the next drafts.  Each timed
    step's host stamps (perf_counter_ns: launch, verify_end, built, sent, drafts, waited) go to
    out["marks"] for the stage breakdown (stage_table)."""
    stats = {"not_arrived": 0, "remapped": 0, "empty": 0}
    kw, counts = rows.call(None, rows._tokens(rows.cfg.batch), drafter.hidden(rows))
    drafter.steps += 1  # call ids keep rising over every run of one session
    drafts, pre = drafter.draft(drafter.steps, kw, counts)
    rows.set_drafts(drafts, pre)
    step_ms, t0, tokens0, marks = [], 0.0, 0, []
    wall_start = time.time()
    picker = getattr(drafter, "picker", None)
    for t in range(warmup + steps):
        if t == warmup:
            t0, tokens0, wall_start = time.perf_counter(), rows.tokens, time.time()
            stats = {"not_arrived": 0, "remapped": 0, "empty": 0}
            rows.pre_rows, rows.pre_tokens = 0, 0
            if picker is not None:  # hit rates and late sets of the timed steps only
                picker.stats = PickerStats()
                drafter.unawaited = 0
        s0 = time.perf_counter()
        launch = time.perf_counter_ns()
        verify.launch()
        accepted = rows.draw_accepted()
        verify.wait()
        verify_end = time.perf_counter_ns()
        rows.tokens += sum(a + 1 for a in accepted)
        sent, next_tokens = drafter.outcomes(rows, accepted, stats)
        drawn = time.perf_counter_ns()
        kw, counts = rows.call(sent, next_tokens, drafter.hidden(rows))
        built = time.perf_counter_ns()
        drafter.steps += 1
        drafts, pre = drafter.draft(drafter.steps, kw, counts)
        rows.set_drafts(drafts, pre)
        step_ms.append((time.perf_counter() - s0) * 1e3)
        if t >= warmup:
            marks.append({"step": drafter.steps, "launch": launch, "verify_end": verify_end, "drawn": drawn,
                          "built": built, "sent": drafter.sent_ns, "drafts": time.perf_counter_ns(),
                          "waited": drafter.waited, "bound": getattr(drafter, "last_stamps", None),
                          "pd": getattr(drafter, "last_pd", None), "bstep": getattr(drafter, "last_bstep", None)})
    wall = time.perf_counter() - t0
    out = {"tokens_per_s": (rows.tokens - tokens0) / wall, "steps": steps, "wall": [wall_start, time.time()],
           "tokens_per_step": (rows.tokens - tokens0) / steps / rows.cfg.batch,
           "step_ms_p50": statistics.median(step_ms[warmup:]), "step_ms_mean": 1e3 * wall / steps, **stats,
           "predrafted_rows": rows.pre_rows,
           "tokens_per_predrafted_row": rows.pre_tokens / rows.pre_rows if rows.pre_rows else None, "marks": marks}
    if picker is not None:
        out.update(hit_rate=picker.stats.hit_rate, hits_by_a=picker.stats.hit_rate_by_a(),
                   sets=picker.stats.offered, late_sets=picker.stats.late, unawaited=drafter.unawaited)
    return out


# --------------------------------------------------------------------------- where the step's time goes
# (name, value in ns from the target's step stamps m, the drafter's marks d of the same call, the
# target's stamps n of the next step; None where it does not apply).  One host clock on both sides.
STAGES = (
    ("A verify end -> outcome drawn", lambda m, d, n: m["drawn"] - m["verify_end"]),
    ("B outcome -> call built (hidden states to the host for ZMQ)", lambda m, d, n: m["built"] - m["drawn"]),
    ("C built -> sent (pick, request)", lambda m, d, n: m["sent"] - m["built"]),
    ("D sent -> drafter read it", lambda m, d, n: d["start"] - m["sent"] if "start" in d else None),
    ("E drafter: read -> engine thread (decode, validate, queue)",
     lambda m, d, n: d["handoff_in"] - d["start"] if "handoff_in" in d else None),
    ("F drafter: engine (prepare, draft, drafts to host)",
     lambda m, d, n: d["engine"] - d["handoff_in"] if "engine" in d else None),
    ("G drafter: engine -> reply sent", lambda m, d, n: d["send"] - d["engine"] if "send" in d else None),
    ("H reply sent -> drafts at the target (waited steps)",
     lambda m, d, n: m["drafts"] - d["send"] if "send" in d and m["waited"] else None),
    ("I drafter: reply -> pre-draft engine start",
     lambda m, d, n: d["predraft_engine_start"] - d["send"] if "predraft_engine_start" in d else None),
    ("J drafter: pre-draft engine (graph replay, outcomes to host)",
     lambda m, d, n: d["predraft_engine"] - d["predraft_engine_start"] if "predraft_engine" in d else None),
    ("J1 pre-draft: inputs to the GPU, up to the replay",
     lambda m, d, n: d["replay_start"] - d["predraft_engine_start"] if "replay_start" in d else None),
    ("J2 pre-draft: replay launched and done (stream synchronised)",
     lambda m, d, n: d["replay_done"] - d["replay_start"] if "replay_done" in d else None),
    ("J3 pre-draft: outcomes to the host", lambda m, d, n: d["predraft_engine"] - d["replay_done"]
     if "replay_done" in d else None),
    ("K drafter: pre-draft -> push sent", lambda m, d, n: d["push"] - d["predraft_engine"] if "push" in d
     and "predraft_engine" in d else None),
    ("R drafter: reply sent -> the event loop's bookkeeping of it (after any pre-draft)",
     lambda m, d, n: d["loop_done_start"] - d["send"] if "loop_done_start" in d and "send" in d else None),
    ("L push slack: next verify end - push sent (< 0: late)",
     lambda m, d, n: n["verify_end"] - d["push"] if "push" in d and n is not None else None),
    ("L2 bound: fill the slab -> header sent",
     lambda m, d, n: (m["bound"] or {})["sent"] - m["sent"] if "sent" in (m.get("bound") or {}) else None),
    ("M bound: header sent -> drafter read it", lambda m, d, n: _span(m, "received", "sent")),
    ("N bound: drafter read -> step started", lambda m, d, n: _span(m, "started", "received")),
    ("O bound: started -> GPU work queued", lambda m, d, n: _span(m, "queued", "started")),
    ("P bound: queued -> reply", lambda m, d, n: _span(m, "replied", "queued")),
    ("Q bound: reply -> drafts on the target's host", lambda m, d, n: _span(m, "read", "replied")),
    ("Q1 bound: reply -> StepDone read by the target", lambda m, d, n: _span(m, "answered", "replied")),
    ("Q2 bound: StepDone read -> drafts on the target's host (event wait, copy)",
     lambda m, d, n: _span(m, "read", "answered")),
    # a bound pre-draft step on the target's side (BoundPreDrafting.stamps), waited or not
    ("S bound pre-draft: pushes read, rows picked", lambda m, d, n: _pd(m, "picked") - m["sent"]
     if _pd(m, "picked") else None),
    ("T bound pre-draft: settle (the last unawaited step's StepDone and event)",
     lambda m, d, n: _pd_span(m, "settled", "picked")),
    ("U bound pre-draft: fill the views", lambda m, d, n: _pd_span(m, "filled", "settled")),
    ("V2 bound pre-draft: header out without waiting", lambda m, d, n: _pd_span(m, "sent", "filled")),
    ("Y bound pre-draft: drafts read -> TAKEN sent", lambda m, d, n: _pd(m, "taken") - (m["bound"] or {})["read"]
     if _pd(m, "taken") and "read" in (m.get("bound") or {}) else None),
    # the drafter's pre-draft after this step's StepDone (drafter.service.predraft.BOUND_MARKS)
    ("W1 drafter: StepDone sent -> the step's fields on its host (its GPU work done)",
     lambda m, d, n: _d_span(d, "fields", "after_reply")),
    ("W2 drafter: outcomes read, budget, merge", lambda m, d, n: _d_span(d, "decided", "fields")),
    ("W2T drafter: waiting for the target's TAKEN", lambda m, d, n: _d_span(d, "taken", "decided")),
    ("W3 drafter: pre-draft queued (engine lock)", lambda m, d, n: _d_span(d, "queued", "taken" if "taken" in d
                                                                            else "decided")),
    ("W4 drafter: pre-draft done (host waited)", lambda m, d, n: _d_span(d, "finished", "queued")),
    ("W5 drafter: push sent", lambda m, d, n: _d_span(d, "pushed", "finished")),
    ("WG drafter: the pre-draft's GPU time (timing events)",
     lambda m, d, n: d["gpu_us"] * 1e3 if d.get("gpu_us") is not None else None),
    ("X2 bound: drafts on the target's host - the pre-draft queued (> 0: read after it was queued)",
     lambda m, d, n: (m["bound"] or {})["read"] - d["queued"] if "read" in (m.get("bound") or {})
     and "queued" in d else None),
    ("L3 bound push slack: next verify end - push sent (< 0: late)",
     lambda m, d, n: n["verify_end"] - d["pushed"] if "pushed" in d and n is not None else None),
    ("Z critical path past the verify: verify end -> drafts in hand", lambda m, d, n: m["drafts"] - m["verify_end"]),
)


def _span(m: dict, end: str, start: str) -> int | None:
    b = m.get("bound") or {}
    return b[end] - b[start] if end in b and start in b else None


def _pd(m: dict, name: str) -> int | None:
    return (m.get("pd") or {}).get(name)


def _pd_span(m: dict, end: str, start: str) -> int | None:
    a, b = _pd(m, end), _pd(m, start)
    return a - b if a is not None and b is not None else None


def _d_span(d: dict, end: str, start: str) -> int | None:
    return d[end] - d[start] if end in d and start in d else None


def _records(path: str) -> list[dict]:
    """The JSON lines of the drafter's stage marks file (none where it is missing; a line still being
    written is skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def server_marks(path: str, first: int, last: int) -> dict[int, dict[str, int]]:
    """The drafter's stage marks (drafter.tools.bench.predraft record_stages) of calls first..last,
    by request id: {stage: perf_counter_ns}, each stage's first mark."""
    out: dict[int, dict[str, int]] = {}
    for rec in _records(path):
        if "request_id" not in rec:  # a bound step's pre-draft (bound_marks)
            continue
        if first <= rec["request_id"] <= last:  # a call may have several lines (the loop's own marks apart)
            marks = out.setdefault(rec["request_id"], {})
            for name, ns in rec["marks"]:
                marks.setdefault(name, ns)
    return out


def bound_marks(path: str, start_ns: int, end_ns: int) -> dict[int, dict]:
    """The drafter's bound pre-draft marks (record_stages' bound_marks lines) whose pre-draft began
    in [start_ns, end_ns] (one binding runs at a time here), by the binding's step: {stage: ns,
    "gpu_us": the pre-draft's GPU microseconds or None}."""
    out: dict[int, dict] = {}
    for rec in _records(path):
        if "bound_step" not in rec or not rec["marks"] or not start_ns <= rec["marks"][0][1] <= end_ns:
            continue
        marks = {name: ns for name, ns in rec["marks"]}
        marks["gpu_us"] = rec.get("gpu_us")
        out[int(rec["bound_step"])] = marks
    return out


def step_values(marks: list[dict], drafter_marks: dict[int, dict], bound: dict[int, dict] | None = None,
                ) -> list[dict]:
    """Per timed step, each stage's microseconds (STAGES) and whether the target waited."""
    rows = []
    for i, m in enumerate(marks):
        nxt = marks[i + 1] if i + 1 < len(marks) else None
        d = (bound or {}).get(m.get("bstep"), {}) if bound else drafter_marks.get(m["step"], {})
        row = {"waited": bool(m.get("waited", True))}
        for name, fn in STAGES:
            try:
                v = fn(m, d, nxt)
            except KeyError:
                v = None
            if v is not None:
                row[name] = round(v / 1e3, 1)
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Per stage the p50 and count in microseconds over the given steps."""
    per: dict[str, list[float]] = {}
    for row in rows:
        for name, v in row.items():
            if name != "waited":
                per.setdefault(name, []).append(v)
    order = [name for name, _ in STAGES if name in per]
    return {name: {"p50_us": round(statistics.median(per[name]), 1), "n": len(per[name])} for name in order}


def stage_summary(marks: list[dict], drafter_marks: dict[int, dict[str, int]]) -> dict:
    """Per stage (STAGES) the p50 and count in microseconds over the run's timed steps."""
    return summarize(step_values(marks, drafter_marks))


def per_step(rows: list[dict]) -> list[dict]:
    """The steps' stage values keyed by each stage's letter (the JSON's per-step record)."""
    return [{("waited" if k == "waited" else k.split()[0]): v for k, v in row.items()} for row in rows]


def stage_lines(results: list[dict]) -> list[str]:
    """One row per run: each stage's p50 microseconds (a letter per column; the legend below)."""
    names = [name for name, _ in STAGES if any(name in r.get("stages", {}) for r in results)]
    if not names:
        return []
    lines = ["| V ms | batch | k | mode | " + " | ".join(n.split()[0] for n in names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for r in results:
        for label, key in (("", "stages"), (" (waited)", "stages_waited"), (" (unawaited)", "stages_unawaited")):
            st = r.get(key)
            if not st:
                continue
            n_steps = f" n={next(iter(st.values()))['n']}" if key != "stages" else ""
            lines.append(f"| {r['verify_ms']:g} | {r['batch']} | {r['k']} | {r['mode']}{label}{n_steps} | "
                         + " | ".join(f"{st[n]['p50_us']:.0f}" if n in st else "" for n in names) + " |")
    return lines + ["", "Columns (p50 microseconds over the timed steps; one host clock on both sides):", ""] + \
        [f"* {n}" for n in names]


# --------------------------------------------------------------------------- the drafters
def _model_dir(tiny: bool) -> str:
    from drafter.tools.bench.remote import HEAD_CONFIG, TINY

    d = tempfile.mkdtemp(prefix="predraft-head-")
    Path(d, "config.json").write_text(json.dumps({**HEAD_CONFIG, **(TINY if tiny else {})}))
    return d


def _server_argv(model_dir: str, k: int, args, outcomes: int, kp: int = 0) -> list[str]:
    """The served drafter's arguments; kp > k: pre-drafts of k' = kp drafts (--predraft-k), the token
    buffers and graphs sized for a step after hits (k' + 1 tokens a row) besides exact steps (k + 1)."""
    from drafter.tools.bench.remote import server_args

    b = max(args.batches)
    span = max(k, kp)
    base = server_args(model_dir, b, k, args.max_len - 64, _kv_blocks(args, b), args.drafter_device)
    base[base.index("--max-num-batched-tokens") + 1] = str(b * (span + 1))
    tokens = sorted({x * (k + 1) for x in args.batches} | {x * (span + 1) for x in args.batches})
    deeper = ["--predraft-k", str(kp)] if outcomes and kp > k else []
    return base + ["--capture-sizes", ",".join(map(str, args.batches)),
                   "--token-capture-sizes", ",".join(map(str, tokens)),
                   "--predraft-outcomes", str(outcomes), *deeper, "--log-level", "info"]


def _kv_blocks(args, batch: int) -> int:
    return batch * -(-args.max_len // BLOCK_SIZE) + 8


def start_server(model_dir: str, k: int, args, run_dir: str, kp: int = 0) -> tuple[subprocess.Popen, str]:
    tag = _tag(k, kp)
    sock = f"{run_dir}/{tag}.sock"
    cmd = [sys.executable, "-m", "drafter.tools.bench.predraft", "serve",
           *_server_argv(model_dir, k, args, args.outcomes, kp), "--zmq-ipc", sock]
    env = {**os.environ, "DRAFTER_STAGES_OUT": stages_path(args.out, k, kp)}  # every call's stage marks (JSON lines)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env), f"ipc://{sock}"


def _tag(k: int, kp: int = 0) -> str:
    """A server's name: k3, or k3p6 where it pre-drafts k' = 6 > k."""
    return f"k{k}" + (f"p{kp}" if kp > k else "")


def stages_path(out_dir, k: int, kp: int = 0) -> str:
    """The server's per-call stage marks (JSON lines), kept beside the results."""
    return f"{out_dir}/predraft_stages_{_tag(k, kp)}.jsonl"


def attach(endpoint: str, batch: int, args):
    from coordinator.transport import ZmqDrafterClient

    client = ZmqDrafterClient(endpoint, timeout_s=60)
    client.attach(attach_request(endpoint, batch, args, client))
    return client


def attach_request(endpoint: str, batch: int, args, client=None):
    """The session the bench asks for: the server's layout, `batch` rows of max_len positions."""
    from coordinator.transport import ZmqDrafterClient
    from drafter.wire import schema

    own = client is None
    client = client or ZmqDrafterClient(endpoint, timeout_s=60)
    info = client.info()
    if own:
        client.close()
    return schema.AttachRequest(
        protocol_version=info.protocol_version, method=info.method, num_speculative_tokens=info.num_speculative_tokens,
        speculative_token_tree=info.speculative_token_tree, hidden_dtype="bfloat16", hidden_size=info.hidden_size,
        num_aux_layers=info.num_aux_layers, max_model_len=info.limits.max_model_len, max_num_seqs=batch,
        max_num_batched_tokens=info.limits.max_num_batched_tokens,
        kv_groups=[schema.KVGroup(block_size=BLOCK_SIZE, num_blocks=batch * -(-args.max_len // BLOCK_SIZE))],
        client_name=f"predraft-bench-b{batch}")


def in_process_engine(model_dir: str, k: int, args):
    """The server's engine, built the same way, on the target's device, pre-drafting off."""
    from drafter.tools.bench.predraft import served_engine

    argv = _server_argv(model_dir, k, args, 0)
    argv[argv.index("--device") + 1] = args.target_device
    return served_engine(model_dir, argv)


def drain(proc: subprocess.Popen, path: Path, label: str) -> threading.Thread:
    """Copy a ready server's stdout into `path` (a pipe nobody reads would stall its logging)."""
    def copy():
        with path.open("a") as f:
            for line in proc.stdout:
                f.write(f"[{label}] {line}")
                f.flush()
    t = threading.Thread(target=copy, daemon=True)
    t.start()
    return t


def prime(endpoint: str, k: int, args, target, assume: Assumptions, verify: Verify, kp: int = 0) -> None:
    """A throwaway pre-drafting session: the server's first pre-drafts (and its graph capture)."""
    b = max(args.batches)
    rows = Rows(SimConfig(b, k, args.ctx, args.max_len, 1000 if args.tiny else 128256,
                          3 * (128 if args.tiny else 4096), seed=1, predraft_k=kp), target, torch.bfloat16, assume)
    drafter = PreDraft(attach(endpoint, b, args))
    try:
        t0 = time.perf_counter()
        run(rows, drafter, verify, steps=6, warmup=0)
        print(f"  server {_tag(k, kp)} primed in {time.perf_counter() - t0:.1f} s", flush=True)
    except Exception:  # noqa: BLE001 - the timed runs will say what fails
        traceback.print_exc()
    finally:
        drafter.close()


# --------------------------------------------------------------------------- what is reachable
def reachable(v_ms: float, batch: int, d_ms: float, tau_k: float, h: float, t_hit: float) -> dict:
    """The best pre-drafting can do in target tokens/s, given: the verify V, the in-process draft's
    cost past it D (a waited step costs V + D, i.e. exact remote drafting as cheap as in-process),
    the exact drafts' tokens per row and step tau_k, the per-row hit rate h and the tokens a row
    emits when it verifies a pre-draft t_hit (E[accepted | hit] + 1), and hits costing nothing past
    the verify.  Rows hit independently, j of b with Binomial(b, h).  Two round-trip rules:

      all_hit   a step goes without waiting only when every row hits (h^b of steps); otherwise it
                waits and verifies exact drafts in every row
      no_wait   the best threshold t: a step with at least t hit rows goes without waiting, its
                missed rows verifying no drafts (one token each); t = b is all_hit

    and perfect: every row hits every step (b t_hit / V).  Tokens/s, and the threshold chosen."""
    from math import comb

    def at(t: int) -> float:
        tokens = time_ms = 0.0
        for j in range(batch + 1):
            pj = comb(batch, j) * h ** j * (1 - h) ** (batch - j)
            if j >= t:
                tokens += pj * (j * t_hit + (batch - j))
                time_ms += pj * v_ms
            else:
                tokens += pj * batch * tau_k
                time_ms += pj * (v_ms + d_ms)
        return 1e3 * tokens / time_ms

    best_t = max(range(1, batch + 1), key=at)
    return {"all_hit": at(batch), "no_wait": at(best_t), "threshold": best_t, "perfect": 1e3 * batch * t_hit / v_ms}


def deeper_table(results: list[dict], assume: Assumptions, verify_ms, batches) -> list[str]:
    """Pre-drafts at each depth k' (bound pushes and the others measured) against in-process at its
    best k, with what is reachable in principle (`reachable`) from each run's own hit rate and
    tokens per pre-drafted row (the model's f tau(k') where no row verified a pre-draft), and the
    in-process run's step past V at the same k."""
    lines = ["| V ms | batch | in-process best (k) | pre-draft run (mode, k -> k') | tok/s | hit | hits by a | "
             "tok per pre-drafted row | unawaited | pre-draft GPU ms | / in-proc same k | / in-proc best | "
             "reachable, all rows hit | reachable, best no-wait (t) | reachable at h = 1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in verify_ms:
        for b in batches:
            mine = [r for r in results if r["verify_ms"] == v and r["batch"] == b]
            inproc = {r["k"]: r for r in mine if r["mode"] == "in_process"}
            best = max(inproc.values(), key=lambda r: r["tokens_per_s"], default=None)
            for r in (x for x in mine if x["mode"].startswith("predraft")):
                same = inproc.get(r["k"])
                kp = r.get("predraft_k", r["k"])
                hit = r.get("hit_rate", 0.0)
                t_hit = r.get("tokens_per_predrafted_row") or assume.predraft_factor * assume.tau(kp)
                cells = ["-"] * 3
                if same is not None and best is not None:
                    got = reachable(v, b, max(0.0, same["step_ms_mean"] - v), same["tokens_per_step"], hit, t_hit)
                    cells = [f"{got['all_hit'] / best['tokens_per_s']:.3f}",
                             f"{got['no_wait'] / best['tokens_per_s']:.3f} ({got['threshold']})",
                             f"{got['perfect'] / best['tokens_per_s']:.3f}"]
                gpu = (r.get("stages") or {}).get(next((n for n, _ in STAGES if n.startswith("WG ")), ""), {})
                by_a = "/".join(f"{x:.2f}" for _, x in sorted((r.get("hits_by_a") or {}).items()))
                lines.append(
                    f"| {v:g} | {b} | " + (f"{best['tokens_per_s']:.0f} ({best['k']})" if best else "-") +
                    f" | {r['mode']}, {r['k']} -> {kp} | {r['tokens_per_s']:.0f} | {hit:.2f} | {by_a or '-'} | "
                    f"{t_hit:.2f} | {r.get('unawaited', '-')}/{r['steps']} | "
                    + (f"{gpu['p50_us'] / 1e3:.2f}" if gpu else "-") + " | "
                    + (f"{r['tokens_per_s'] / same['tokens_per_s']:.3f}" if same else "-") + " | "
                    + (f"{r['tokens_per_s'] / best['tokens_per_s']:.3f}" if best else "-") + " | "
                    + " | ".join(cells) + " |")
    return lines


# --------------------------------------------------------------------------- the table
def table(results: list[dict], verify_ms, batches) -> list[str]:
    lines = ["| V ms | batch | in-process best (k) | exact remote best (k) | exact bound best (k) | pre-draft k=3 (hit) | "
             "pre-draft best (k, hit) | pre k=3 / in-proc best | pre best / in-proc best | pre k=3 / in-proc k=3 | "
             "no-wait best (k, hit) | no-wait best / in-proc best | bound pre-draft k=3 (hit) | "
             "bound pre-draft best (k, hit) | bound pre k=3 / in-proc k=3 | bound pre best / in-proc best | "
             "bound no-wait best (k, hit) | bound no-wait best / in-proc best | bound early k=3 (hit) | "
             "bound early k=3 / in-proc k=3 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in verify_ms:
        for b in batches:
            mine = [r for r in results if r["verify_ms"] == v and r["batch"] == b]
            if not mine:
                continue

            def best(mode):
                got = [r for r in mine if r["mode"] == mode]
                return max(got, key=lambda r: r["tokens_per_s"]) if got else None

            def at(mode, k):
                return next((r for r in mine if r["mode"] == mode and r["k"] == k and r.get("predraft_k", k) == k),
                            None)
            ip, ex, pb, p3, ip3 = best("in_process"), best("exact_remote"), best("predraft"), at("predraft", 3), \
                at("in_process", 3)
            nw, eb = best("predraft_nowait"), best("exact_bound")
            bp, bp3 = best("predraft_bound"), at("predraft_bound", 3)
            bn, be3 = best("predraft_bound_nowait"), at("predraft_bound_early", 3)

            def cell(r, hit=False):
                if r is None:
                    return "-"
                kp = r.get("predraft_k", r["k"])
                depth = f"{r['k']}" + (f"->{kp}" if kp != r["k"] else "")  # k -> k' for deeper pre-drafts
                return f"{r['tokens_per_s']:.0f} ({depth}" + (f", {r['hit_rate']:.2f})" if hit else ")")

            def ratio(x, y):
                return f"{x['tokens_per_s'] / y['tokens_per_s']:.3f}" if x and y else "-"
            lines.append(f"| {v:g} | {b} | {cell(ip)} | {cell(ex)} | {cell(eb)} | {cell(p3, True)} | {cell(pb, True)} | "
                         f"{ratio(p3, ip)} | {ratio(pb, ip)} | {ratio(p3, ip3)} | {cell(nw, True)} | {ratio(nw, ip)} | "
                         f"{cell(bp3, True)} | {cell(bp, True)} | {ratio(bp3, ip3)} | {ratio(bp, ip)} | "
                         f"{cell(bn, True)} | {ratio(bn, ip)} | {cell(be3, True)} | {ratio(be3, ip3)} |")
    return lines


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--ks", default="3,4,5,6")
    p.add_argument("--outcomes", type=int, default=4, help="the server's --predraft-outcomes")
    p.add_argument("--verify-ms", default="10,25")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--target-device", default="cuda:0")
    p.add_argument("--drafter-device", default="cuda:1")
    p.add_argument("--tiny", action="store_true", help="a tiny head (a smoke run on CPU)")
    p.add_argument("--remote-ks", default="", help="the ks the served modes run at (default: --ks); in-process "
                   "runs every --ks, so its best k stands beside pre-drafts at fewer ks")
    p.add_argument("--predraft-ks", default="", help="pre-draft depths k' for the pre-draft modes (each k' > k a "
                   "server of its own with --predraft-k; default: k' = k)")
    d = Assumptions()
    p.add_argument("--acceptance", default=",".join(map(str, d.acceptance)))
    p.add_argument("--hit-by-a", default=",".join(map(str, d.hit_by_a)))
    p.add_argument("--hit-all", type=float, default=d.hit_all)
    p.add_argument("--predraft-factor", type=float, default=d.predraft_factor)
    args = p.parse_args(argv)
    args.batches, args.ks, modes = _ints(args.batches), _ints(args.ks), [m for m in args.modes.split(",") if m]
    args.remote_ks = _ints(args.remote_ks) or args.ks
    args.predraft_ks = _ints(args.predraft_ks)
    unknown = set(modes) - {"in_process", *REMOTE}
    if unknown:
        p.error(f"--modes: unknown {sorted(unknown)}; choose from in_process, {', '.join(REMOTE)}")
    verify_ms = _floats(args.verify_ms)
    assume = Assumptions(_floats(args.acceptance), _floats(args.hit_by_a), args.hit_all, args.predraft_factor)
    runs = len(verify_ms) * (args.warmup + args.steps + 2)
    deepest = max(args.ks + args.predraft_ks)
    args.max_len = args.ctx + runs * (deepest + 1) + 2 * deepest + 64
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = server_plan(args.remote_ks, args.predraft_ks, modes)  # (k, k') of each server
    for k, kp in plan:  # this run's servers append to them
        Path(stages_path(out, k, kp)).unlink(missing_ok=True)
    target = torch.device(args.target_device)
    name = torch.cuda.get_device_name(target) if target.type == "cuda" else "cpu"
    print(f"pre-draft target bench on {name}: target {args.target_device}, drafter {args.drafter_device}, "
          f"{'tiny' if args.tiny else 'eagle3-8b'} head, batches {args.batches}, k {args.ks}, B {args.outcomes}, "
          f"V {verify_ms} ms, modes {modes}", flush=True)
    from drafter.tools.bench.remote import wait_ready

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: still stop the servers
    model_dir, run_dir = _model_dir(args.tiny), tempfile.mkdtemp(prefix="predraft-ipc-")
    remote = any(m != "in_process" for m in modes)
    servers: dict = {}
    results = []
    sessions = 0
    try:
        # the first server alone (a cold Triton cache compiles once), then the others side by side
        for group in (plan[:1], plan[1:]) if remote else ():
            started = {key: start_server(model_dir, *key[:1], args, run_dir, key[1]) for key in group}
            servers.update(started)
            for key, (proc, _) in started.items():
                wait_ready(proc, timeout_s=300)
                drain(proc, out / "predraft_servers.log", _tag(*key))
                print(f"  server {_tag(*key)} ready", flush=True)
        verifies = {v: Verify(target, v) for v in verify_ms}
        if any(m.startswith("predraft") for m in modes):
            for key in servers:  # a server captures its pre-draft graphs at its first pre-draft: not in a timed run
                prime(servers[key][1], key[0], args, target, assume, verifies[verify_ms[0]], key[1])
        for k in args.ks:
            engine = in_process_engine(model_dir, k, args) if "in_process" in modes else None
            for b in args.batches:
                for mode, kp in runs_at(k, modes, plan):
                    # one session (one attach) per (k, k', batch, mode): its rows run through every V in turn
                    rows = Rows(SimConfig(b, k, args.ctx, args.max_len, 1000 if args.tiny else 128256,
                                          3 * (128 if args.tiny else 4096), seed=b * 100 + k, predraft_k=kp), target,
                                torch.bfloat16, assume)
                    try:
                        if mode == "in_process":
                            drafter = InProcess(engine)
                        elif mode in ("exact_bound", "predraft_bound", "predraft_bound_nowait", "predraft_bound_early"):
                            drafter = REMOTE[mode](bound_client(servers[(k, kp)][1], b, k, args, kp))
                        else:
                            drafter = REMOTE[mode](attach(servers[(k, kp)][1], b, args))
                        sessions += 1
                        drafter.steps = sessions * STEP_BASE  # call ids unique per server: its stage marks join
                    except Exception as exc:  # noqa: BLE001 - one configuration failing leaves the others
                        print(f"  b={b} {_tag(k, kp)} {mode}: FAILED to start: {exc!r}", flush=True)
                        continue
                    try:
                        for v in verify_ms:
                            if isinstance(drafter, PreDraft):
                                drafter.picker.stats = PickerStats()  # per-V hit statistics
                                drafter.unawaited = 0
                            first = drafter.steps + 1
                            r = run(rows, drafter, verifies[v], args.steps, args.warmup)
                            r.update(mode=mode, verify_ms=v, batch=b, k=k, predraft_k=max(k, kp),
                                     outcomes=args.outcomes)
                            served = (k, kp) in servers
                            d = server_marks(stages_path(args.out, k, kp), first, drafter.steps) if served else {}
                            marks = r.pop("marks")
                            bound = None
                            if isinstance(drafter, PreDraftBound) and marks and served:
                                bound = bound_marks(stages_path(args.out, k, kp), marks[0]["launch"],
                                                    marks[-1]["drafts"] + 50_000_000)
                            steps = step_values(marks, d, bound)
                            r["stages"] = summarize(steps)
                            if mode.startswith("predraft_bound"):  # waited and unawaited steps apart
                                r["stages_waited"] = summarize([x for x in steps if x["waited"]])
                                r["stages_unawaited"] = summarize([x for x in steps if not x["waited"]])
                                r["per_step"] = per_step(steps)
                            r["predraft_replayed"] = sum("replay_done" in x for x in d.values())
                            r["predraft_eager"] = sum("replay_refused" in x for x in d.values())
                            results.append(r)
                            _log_run(r)
                            write(out, args, assume, name, modes, verify_ms, results, quiet=True)
                    except Exception:  # noqa: BLE001
                        traceback.print_exc()
                        print(f"  b={b} {_tag(k, kp)} {mode}: FAILED (above)", flush=True)
                    finally:
                        try:
                            drafter.close()
                        except Exception as exc:  # noqa: BLE001
                            print(f"  close failed: {exc!r}", flush=True)
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    write(out, args, assume, name, modes, verify_ms, results)
    return 0


def server_plan(remote_ks: list[int], predraft_ks: list[int], modes) -> list[tuple[int, int]]:
    """The servers to start, (k, k'), k' = k for the plain one: every remote k gets one, and where a
    pre-draft mode runs, each k' > k of --predraft-ks one more (a server pre-drafts one depth)."""
    if not any(m != "in_process" for m in modes):
        return []
    deeper = any(m.startswith("predraft") for m in modes)
    plan = []
    for k in remote_ks:
        if any(not m.startswith("predraft") and m != "in_process" for m in modes) or not deeper or \
                not predraft_ks or any(kp <= k for kp in predraft_ks):
            plan.append((k, k))
        plan += [(k, kp) for kp in predraft_ks if deeper and kp > k]
    return plan


def runs_at(k: int, modes, plan: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """(mode, k') of every session at this k: in-process always (k' = k), exact modes on the plain
    server, pre-draft modes on each server of this k."""
    out = []
    for mode in modes:
        if mode == "in_process":
            out.append((mode, k))
        elif mode.startswith("predraft"):
            out += [(mode, kp) for kk, kp in plan if kk == k]
        elif (k, k) in plan:
            out.append((mode, k))
    return out


REMOTE = {"exact_remote": ExactRemote, "exact_bound": ExactBound, "predraft": PreDraft,
          "predraft_nowait": PreDraftNoWait, "predraft_bound": PreDraftBound,
          "predraft_bound_nowait": PreDraftBoundNoWait, "predraft_bound_early": PreDraftBoundEarly}


def _log_run(r: dict) -> None:
    extra = (f" hit {r['hit_rate']:.2f} unawaited {r['unawaited']} not arrived {r['not_arrived']} "
             f"empty {r['empty']} remapped {r['remapped']} late sets {r['late_sets']} pre-drafts by replay "
             f"{r.get('predraft_replayed')} eager {r.get('predraft_eager')}") if r["mode"].startswith("predraft") else ""
    print(f"  V={r['verify_ms']:g} b={r['batch']:2d} k={r['k']} {r['mode']:12s} {r['tokens_per_s']:9.0f} tok/s  "
          f"{r['tokens_per_step']:.2f} tok/step  step p50 {r['step_ms_p50']:.2f} ms{extra}", flush=True)


def write(out: Path, args, assume: Assumptions, name: str, modes, verify_ms, results: list[dict],
          quiet: bool = False) -> None:
    """predraft_target.json and .md for the runs so far (written after every run: a run cut short keeps them)."""
    lines = table(results, verify_ms, args.batches)
    scales = {k: round(assume.predraft_scale(k), 4) for k in args.ks}
    text = (f"Assumptions: the target's verify is {', '.join(f'{v:g}' for v in verify_ms)} ms of GPU work on "
            f"{args.target_device} (a calibrated sleep kernel), whatever k and batch; accepted lengths drawn from "
            f"acceptance per position {assume.acceptance} (conditional, last repeats for deeper k); rows verifying a "
            f"pre-draft accept with those alphas times {scales} (pre-drafts give {assume.predraft_factor}x the exact "
            f"drafts' tokens per step); an arrived pre-draft set predicts the outcome with probability "
            f"{assume.hit_by_a} when a < k (last repeats) and {assume.hit_all} when all k are accepted; "
            f"{args.outcomes} outcomes pre-drafted per row (k' = k unless the run says k -> k'; a row that verifies a "
            f"pre-draft of k' > k drafts accepts with the same alphas per position, the last repeating, scaled so its "
            f"tokens per step are {assume.predraft_factor}x the exact k'-chain's); drafter: random-weight EAGLE-3 "
            f"head of "
            f"Llama-3.1-8B shapes ({'tiny' if args.tiny else 'bf16'}), Triton + CUDA graphs for drafts and for "
            f"pre-drafts (one replay per call, captured per batch size), on {args.drafter_device} (exact remote and "
            f"pre-draft: unbound ZMQ over ipc://, hidden states copied to the host each step; exact bound: the "
            f"product's bound client, cuda_ipc slab on {args.target_device}) or {args.target_device} (in-process, "
            f"inputs on the device); context {args.ctx} growing by "
            f"the accepted tokens; {args.steps} timed steps after {args.warmup} per configuration.")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "device": name,
            "torch": torch.__version__, "command": " ".join(sys.argv), "assumptions": text,
            "model": asdict(assume), "modes": modes}
    (out / "predraft_target.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    deeper = deeper_table(results, assume, verify_ms, args.batches)
    body = [f"# Pre-drafting against a simulated target ({name}, {meta['date']})", "",
            "Target tokens/s (measured):", "", *lines, "", text, ""]
    if len(deeper) > 2:
        body += ["Pre-draft depth k' against in-process at its best k, and what is reachable in principle "
                 "(ratios to in-process best; `reachable`: each run's own hit rate h and tokens per pre-drafted row, "
                 "the in-process run's step past V at the same k as a waited step's cost, a hit step costing V alone; "
                 "all rows hit: a step skips the round trip only when every row hits, ~h^b; best no-wait: the best "
                 "threshold t of hit rows to send a step unawaited, its missed rows verifying nothing; h = 1: every "
                 "row hits every step):", "", *deeper, ""]
    body += ["Every run:", "",
            "| V ms | batch | k | k' | mode | tok/s | tok/step/row | step p50 ms | hit | unawaited | not arrived "
            "| late sets |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        body.append(f"| {r['verify_ms']:g} | {r['batch']} | {r['k']} | {r.get('predraft_k', r['k'])} | {r['mode']} | "
                    f"{r['tokens_per_s']:.0f} | "
                    f"{r['tokens_per_step']:.2f} | {r['step_ms_p50']:.2f} | {r.get('hit_rate', 0):.2f} | "
                    f"{r.get('unawaited', '-')} | {r.get('not_arrived', '-')} | {r.get('late_sets', '-')} |")
    stages = stage_lines(results)
    if stages:
        body += ["", "Where each step's time goes (p50 us per stage):", "", *stages]
    (out / "predraft_target.md").write_text("\n".join(body) + "\n")
    if not quiet:
        print("\n".join(body), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
