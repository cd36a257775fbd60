"""A generation request as the reference target tracks it.

Positions [0, num_computed) hold final tokens whose KV the target has written; tokens[-1] is the
pending token (sampled, not yet fed back).  `drafts` are the drafter's proposals for the next
step.  `frontier` is the drafter-side mirror: the drafter's KV is right for positions
[0, frontier); rows between the frontier and this step's query are re-sent from `hidden` (a
drafter that missed steps, or restarted, catches up instead of drafting from holes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RequestSpec:
    rid: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0


@dataclass
class StepResult:
    """What the last target step did to one request; the drafter call is built from it."""

    query_start: int  # position of the query's first row
    query: list[int]  # the query's tokens: [last token, d_1 .. d_j] or the prompt
    last_accepted_row: int  # index in query of the last row whose token is final
    next_token: int  # the token sampled after it (the drafter's next_token_ids)
    num_drafts: int = 0  # drafts this step verified (query rows after the first, on a decode step)

    @property
    def seq_len(self) -> int:
        return self.query_start + len(self.query)

    @property
    def num_rejected(self) -> int:
        return len(self.query) - 1 - self.last_accepted_row

    @property
    def accepted_report(self) -> int:
        """Drafts accepted this step, or -1 when none were verified (a prefill, a step without drafts)."""
        return self.last_accepted_row if self.num_drafts else -1


@dataclass
class Request:
    spec: RequestSpec
    blocks: list[int]
    hidden: torch.Tensor  # [capacity, drafter hidden width], the target's hidden rows by position
    pit_generator: torch.Generator  # only for the distribution check, never for sampling (sampling is keyed
    # by (spec.seed, position): verify.verify_coupled, the same on every TP rank and for any drafts)
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    drafts: list[int] = field(default_factory=list)
    frontier: int = 0
    last: StepResult | None = None
    finished: bool = False
    predrafted: bool = False  # this step's drafts are a pre-draft (coordinator.predraft)

    @property
    def rid(self) -> int:
        return self.spec.rid

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.spec.prompt):]

    @property
    def remaining(self) -> int:
        return self.spec.max_new_tokens - len(self.output)


def random_requests(count: int, *, vocab_size: int, max_new_tokens: int, seed: int = 0, first_rid: int = 0,
                    prompt_lens: tuple[int, int] = (8, 16), temperature: float = 0.0) -> list[RequestSpec]:
    """Prompts of random tokens (the tiny models know no language): the demo's and tests' workload."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = int(torch.randint(prompt_lens[0], prompt_lens[1] + 1, (), generator=g))
        prompt = tuple(torch.randint(0, vocab_size, (n,), generator=g).tolist())
        out.append(RequestSpec(first_rid + i, prompt, max_new_tokens, temperature, seed=seed * 100_003 + first_rid + i))
    return out
