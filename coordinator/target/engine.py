"""The reference target engine: schedule, forward, verify, then ask for the next drafts.

One step of one rank:
  1. schedule: admit waiting requests (their query is the prompt) and give every running
     request the query [pending token, d_1 .. d_j] (j = 0 without drafts);
  2. forward the tiny Llama over its paged KV; verify (greedy or rejection sampling);
  3. build the drafter call for the requests that will decode again (drafting.py);
  4. agree on the padded size with the other DP ranks (an idle rank joins with batch 0);
  5. TP rank 0 calls the drafter under a deadline; the outcome is broadcast to the TP group.
Speculation never changes what is generated: a step without drafts is a plain decode step.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
import torch

from coordinator.dp_agreement import DPAgreement, DPPadding, capture_sizes_up_to
from coordinator.target.allocator import BlockAllocator
from coordinator.target.drafting import EMPTY_CALL, CallBuilder, DraftCall, DraftResult, session_spec
from coordinator.target.request import Request, RequestSpec, StepResult
from coordinator.target.runner import AUX_METHODS, ModelRunner, RunnerConfig
from coordinator.target.verify import randomized_pit, target_probs, verify_coupled, verify_greedy
from coordinator.tp import TPFanout

log = logging.getLogger("coordinator.target")


@dataclass(frozen=True)
class TargetConfig:
    target_dir: str
    method: str = "eagle3"  # the drafter's method: which hidden states the drafter consumes
    aux_layer_ids: tuple[int, ...] = ()  # the head's aux layer ids (eagle3 / extract_hidden_states)
    num_speculative_tokens: int = 3  # k; 0 = decode without speculation
    predraft_tokens: int = 0  # k': drafts a row verifies when the drafter sent a deeper pre-draft (0 = k)
    max_model_len: int = 256
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 1024  # the drafter session's limit on one call's rows
    block_size: int = 16
    num_blocks: int = 256
    num_drafter_kv_groups: int = 1
    capture_sizes: tuple[int, ...] = ()  # empty: powers of two up to max_num_seqs
    token_capture_sizes: tuple[int, ...] = ()  # empty: powers of two up to max_num_batched_tokens
    dtype: str = "float32"
    record_calls: bool = False  # keep every drafter call's inputs and drafts (tests replay them)

    def __post_init__(self):
        if self.method in AUX_METHODS and not self.aux_layer_ids:
            raise ValueError(f"method {self.method} consumes aux hidden states: set aux_layer_ids")
        object.__setattr__(self, "capture_sizes", tuple(self.capture_sizes) or capture_sizes_up_to(self.max_num_seqs))
        object.__setattr__(self, "token_capture_sizes",
                           tuple(self.token_capture_sizes) or capture_sizes_up_to(self.max_num_batched_tokens))

    @property
    def blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)


@dataclass(frozen=True)
class StepRecord:
    step: int
    padding: DPPadding
    scheduled_tokens: int  # rows of this step's target forward
    batch: int  # rows of this rank's drafter call (0: none)
    tokens: int
    kind: str  # "draft": took part in a drafter exchange; "dummy": agreement only; "plain": no speculation
    drafts_ok: bool | None  # None when no exchange took place
    wait_s: float  # time spent in the exchange (propose + broadcast, or the broadcast alone)
    batch_padded_run: int | None  # the padded batch the drafter reports it ran (when it says)


@dataclass(frozen=True)
class CallRecord:
    step: int
    kwargs: dict
    padding: DPPadding
    drafts: torch.Tensor | None
    generation: int | None
    accepted_counts: torch.Tensor | None = None


@dataclass
class EngineStats:
    k: int
    proposed: list[int] = field(default_factory=list)  # per draft position: drafts verified
    accepted: list[int] = field(default_factory=list)  # per draft position: drafts accepted
    verify_steps: int = 0  # (request, step) pairs that verified at least one draft
    emitted_in_verify_steps: int = 0
    decode_steps: int = 0  # (request, step) pairs after the prefill
    emitted_in_decode_steps: int = 0
    pit: list[float] = field(default_factory=list)  # sampled tokens' randomised PIT values
    # pre-drafting: per draft position, the drafts verified / accepted that came from a pre-draft
    proposed_pre: list[int] = field(default_factory=list)
    accepted_pre: list[int] = field(default_factory=list)
    # pre-drafting: per hit (rid, output index of the first draft, exact drafts, pre-drafts used)
    hits: list[tuple[int, int, list[int], list[int]]] = field(default_factory=list)

    def __post_init__(self):
        self.proposed = [0] * self.k
        self.accepted = [0] * self.k
        self.proposed_pre = [0] * self.k
        self.accepted_pre = [0] * self.k

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per request-step that had drafts to verify (1.0 = nothing accepted)."""
        return self.emitted_in_verify_steps / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_decode_step(self) -> float:
        return self.emitted_in_decode_steps / self.decode_steps if self.decode_steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]


def _drafted(row: list[int]) -> list[int]:
    """A row's drafts up to its first -1 (no draft: a row padded to a deeper pre-draft's width)."""
    return row[: row.index(-1)] if -1 in row else row


class TargetEngine:
    def __init__(self, cfg: TargetConfig, *, proposer=None, agreement: DPAgreement | None = None,
                 fanout: TPFanout | None = None, runner: ModelRunner | None = None, predraft=None):
        self.cfg = cfg
        # pre-drafting (coordinator.predraft.InProcessPreDrafting): a hit's pre-draft replaces the
        # exact drafts of its row; None = off
        self.predraft = predraft
        self.k = cfg.num_speculative_tokens
        self.verify_k = max(self.k, cfg.predraft_tokens)  # the most drafts one row verifies
        self.runner = runner or ModelRunner(RunnerConfig(
            cfg.target_dir, cfg.block_size, cfg.num_blocks,
            cfg.aux_layer_ids if cfg.method in AUX_METHODS else (), cfg.dtype))
        self.allocator = BlockAllocator(cfg.num_blocks)
        self.proposer = proposer  # TP rank 0 only; other ranks receive through the fan-out
        self.agreement = agreement or DPAgreement(cfg.capture_sizes, cfg.token_capture_sizes)
        self.fanout = fanout or TPFanout(max(1, self.k))
        self.builder = CallBuilder(k=self.k, max_model_len=cfg.max_model_len, block_size=cfg.block_size,
                                   blocks_per_req=cfg.blocks_per_req, num_kv_groups=cfg.num_drafter_kv_groups,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens)
        self.waiting: deque[RequestSpec] = deque()
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self.stats = EngineStats(self.verify_k)
        self.steps: list[StepRecord] = []
        self.calls: list[CallRecord] = []

    # ---------------------------------------------------------------- requests
    def add(self, spec: RequestSpec) -> None:
        if len(spec.prompt) + spec.max_new_tokens > self.cfg.max_model_len:
            raise ValueError(f"request {spec.rid}: prompt + max_new_tokens exceeds max_model_len")
        if not spec.prompt or spec.max_new_tokens < 1:
            raise ValueError(f"request {spec.rid}: needs a prompt and max_new_tokens >= 1")
        self.waiting.append(spec)

    def _blocks_needed(self, spec: RequestSpec) -> int:
        # reserve the whole lifetime up front (no preemption), plus the drafter's lookahead slots
        span = min(self.cfg.max_model_len, len(spec.prompt) + spec.max_new_tokens + self.verify_k + 1)
        return -(-span // self.cfg.block_size)

    def _admit(self) -> list[Request]:
        admitted = []
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            spec = self.waiting[0]
            need = self._blocks_needed(spec)
            if need >= self.cfg.num_blocks:
                raise ValueError(f"request {spec.rid} needs {need} blocks, the pool has {self.cfg.num_blocks - 1}")
            if not self.allocator.can_allocate(need):
                break
            self.waiting.popleft()
            req = Request(
                spec=spec, blocks=self.allocator.allocate(need),
                hidden=torch.zeros(self.cfg.max_model_len, self.runner.drafter_hidden_width),
                pit_generator=torch.Generator().manual_seed(spec.seed + 7919),
                tokens=list(spec.prompt))
            self.running.append(req)
            admitted.append(req)
        return admitted

    def session_spec(self, client: str = ""):
        """What this engine's drafter session must look like (see coordinator.session)."""
        cfg = self.cfg
        aux = len(cfg.aux_layer_ids) if cfg.method in AUX_METHODS else 0
        return session_spec(method=cfg.method, k=self.k, hidden_size=self.runner.spec.hidden_size,
                            num_aux_layers=aux, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                            max_num_batched_tokens=cfg.max_num_batched_tokens, block_size=cfg.block_size,
                            num_blocks=cfg.num_blocks, num_kv_groups=cfg.num_drafter_kv_groups, dtype=cfg.dtype,
                            client=client)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- one step
    def step(self) -> StepRecord:
        self._admit()
        scheduled = self._forward_and_verify()
        done = [r for r in self.running if r.finished]
        for req in done:
            self.allocator.free(req.blocks)
            self.finished[req.rid] = req
        self.running = [r for r in self.running if not r.finished]
        if self.k == 0:
            padding = self.agreement.agree(0, 0, self.has_work)
            rec = StepRecord(padding.step, padding, scheduled, 0, 0, "plain", None, 0.0, None)
        else:
            rec = self._exchange_drafts(scheduled)
        self.steps.append(rec)
        return rec

    def run(self) -> dict[int, list[int]]:
        """Step until every rank of the DP group is out of work; returns outputs by request id."""
        while True:
            rec = self.step()
            if not rec.padding.any_work:
                return {rid: r.output for rid, r in sorted(self.finished.items())}

    def _forward_and_verify(self) -> int:
        plan = []  # (request, query start, query tokens, drafts verified)
        for req in self.running:
            if req.num_computed == 0:
                plan.append((req, 0, list(req.tokens), 0))
                continue
            start = req.num_computed
            drafts = _drafted(req.drafts)
            j = min(len(drafts), self.verify_k, req.remaining - 1, self.cfg.max_model_len - 1 - start)
            j = max(0, j)
            plan.append((req, start, [req.tokens[-1]] + drafts[:j], j))
        if not plan:
            return 0
        bs = self.cfg.block_size
        ids, positions, qsl, seq_lens, tables = [], [], [0], [], []
        for req, start, query, _ in plan:
            ids.extend(query)
            positions.append(torch.arange(start, start + len(query)))
            qsl.append(qsl[-1] + len(query))
            seq_lens.append(start + len(query))
            row = torch.zeros(self.cfg.blocks_per_req, dtype=torch.int32)
            row[: len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)
            tables.append(row)
        pos = torch.cat(positions)
        table = torch.stack(tables)
        owner = torch.repeat_interleave(torch.arange(len(plan)), torch.tensor([len(p[2]) for p in plan]))
        slots = table[owner, pos // bs].long() * bs + pos % bs
        out = self.runner.forward(torch.tensor(ids, dtype=torch.long), pos, torch.tensor(qsl, dtype=torch.int32),
                                  torch.tensor(seq_lens, dtype=torch.int32), table, slots)
        for i, (req, start, query, j) in enumerate(plan):
            rows = slice(qsl[i], qsl[i + 1])
            req.hidden[start: start + len(query)] = out.drafter_hidden[rows].float()
            self._verify(req, start, query, j, out.logits[rows])
        return qsl[-1]

    def _verify(self, req: Request, start: int, query: list[int], j: int,
                logits: torch.Tensor) -> None:  # logits: [len(query), V]
        prefill = req.num_computed == 0
        temp = req.spec.temperature
        if prefill:
            logits = logits[-1:]
            drafts: list[int] = []
        else:
            drafts = query[1:]
        probs = target_probs(logits, temp) if temp > 0 else None
        if probs is None:
            verdict = verify_greedy(logits, drafts)
        else:  # the drafts are one-hot: each position's sample keyed by (seed, position), whatever was drafted
            first = start + (len(query) if prefill else 1)
            verdict = verify_coupled(probs, drafts, req.spec.seed, first)
        if probs is not None:
            for i, tok in enumerate(verdict.tokens):
                u = float(torch.rand((), generator=req.pit_generator))
                self.stats.pit.append(randomized_pit(probs[i], tok, u))
        last_row = len(query) - 1 if prefill else verdict.num_accepted
        req.tokens.extend(verdict.tokens)
        req.num_computed = start + last_row + 1
        req.last = StepResult(start, query, last_row, verdict.tokens[-1], j)
        req.finished = req.remaining <= 0
        if not prefill:
            s = self.stats
            s.decode_steps += 1
            s.emitted_in_decode_steps += verdict.num_emitted
            if j:
                s.verify_steps += 1
                s.emitted_in_verify_steps += verdict.num_emitted
                for pos in range(j):
                    s.proposed[pos] += 1
                    s.accepted[pos] += int(pos < verdict.num_accepted)
                    if req.predrafted:
                        s.proposed_pre[pos] += 1
                        s.accepted_pre[pos] += int(pos < verdict.num_accepted)

    def _exchange_drafts(self, scheduled: int) -> StepRecord:
        call = self.builder.build(self.running)
        padding = self.agreement.agree(call.batch, call.num_tokens, self.has_work)
        if not call.batch:
            self.builder.apply(EMPTY_CALL, DraftResult(None, self.builder.generation), self.running)
            return StepRecord(padding.step, padding, scheduled, 0, 0, "dummy", None, 0.0, None)
        t0 = time.perf_counter()
        ran = []
        hits = self.predraft.pick(padding.step, call.kwargs, call.accepted_counts) if self.predraft else None
        result = self.fanout.share(call.batch, lambda: self._propose(call, padding, ran))
        wait = time.perf_counter() - t0
        if hits is not None:
            result = self._use_predrafts(call, padding.step, hits, result)
        ok = self.builder.apply(call, result, self.running)
        if self.cfg.record_calls and self.fanout.is_src:
            self.calls.append(CallRecord(padding.step, call.kwargs, padding, result.drafts, result.generation,
                                         call.accepted_counts))
        return StepRecord(padding.step, padding, scheduled, call.batch, call.num_tokens, "draft", ok, wait,
                          ran[0] if ran else None)

    def _use_predrafts(self, call: DraftCall, step: int, hits: list, result: DraftResult) -> DraftResult:
        """Verify a hit's pre-draft instead of the exact drafts of its row, then let the drafter
        pre-draft for the drafts now used.  Verification decides either way: output is unchanged."""
        from drafter.wire.predraft import merge

        for req in self.running:
            req.predrafted = False
        if result.drafts is None:
            return result
        used, flags = merge(result.drafts, hits)
        for req, hit, exact, pre in zip(call.requests, flags, result.drafts.tolist(), used.tolist()):
            req.predrafted = hit
            if hit:
                self.stats.hits.append((req.rid, len(req.output), exact, pre))
        self.predraft.after(step, call.kwargs, used, result.generation)
        return DraftResult(used, result.generation)

    def _propose(self, call: DraftCall, padding: DPPadding, ran: list) -> DraftResult:
        try:
            drafts = self.proposer.propose(**call.kwargs, batch_padded=padding.batch_padded,
                                           tokens_padded=padding.tokens_padded, accepted_counts=call.accepted_counts)
        except Exception:  # noqa: BLE001 - the proposer fails closed itself; this guards the TP peers
            # waiting in the broadcast: whatever happens here, they get "no drafts", not a hang
            log.exception("proposer raised; no drafts this step")
            return DraftResult(None, self.builder.generation)
        padded = getattr(self.proposer, "last_batch_padded", None)
        if padded is not None:
            ran.append(padded)
        return DraftResult(drafts, self.proposer.generation)
