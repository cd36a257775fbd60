"""BoundSteps (drafter.service.batching.bound_steps) with stand-in sessions and engine: which pending
steps share an engine call, what each owner gets back, and that a ticket is served exactly once.
The real sessions and engine: tests/integration/test_bound_fused.py."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from drafter.service.batching.bound_steps import BoundSteps
from drafter.wire.errors import DrafterError, invalid
from drafter.wire.records import ProposeInputs

WIDTH = 2


class Engine:
    """Captured sizes and limits; draft() answers each row with its first token id (so the test sees
    which rows came back to whom) and records the sizes it was called with."""

    def __init__(self, batch_sizes=(2, 4), token_sizes=(8, 16)):
        self.graphs = SimpleNamespace(batch_sizes=list(batch_sizes), token_sizes=list(token_sizes))
        self.limits = SimpleNamespace(max_num_seqs=max(batch_sizes), max_num_batched_tokens=max(token_sizes))
        self.calls: list[tuple[int, int, int, int]] = []  # (batch, tokens, batch_padded, tokens_padded)

    def on_device(self):
        return contextlib.nullcontext()

    def draft(self, inp: ProposeInputs, *, batch_padded, tokens_padded, validate):
        assert not validate
        self.calls.append((inp.batch_size, inp.num_tokens, batch_padded, tokens_padded))
        firsts = inp.target_token_ids[inp.query_start_loc[:-1].long()]
        return SimpleNamespace(draft_token_ids=firsts[:, None].repeat(1, WIDTH))


class Session:
    """A stand-in binding: its rows' token ids are its tag; refuse: fuse_part's refusal."""

    host_reply = True

    def __init__(self, tag: int, refuse: str | None = None, dtype=torch.float32):
        self.tag, self.refuse, self.dtype = tag, refuse, dtype
        self.session = SimpleNamespace(bases=(0,))
        self.alone = 0
        self.drafts = None
        self.bound = SimpleNamespace(inputs=SimpleNamespace(target_token_ids=torch.zeros(1, dtype=torch.int64),
                                                            target_hidden_states=torch.zeros(1, 1, dtype=dtype)))

    def serve_alone(self, head, nbytes):
        self.alone += 1
        return f"alone {self.tag}"

    def fuse_part(self, head, nbytes) -> ProposeInputs:
        if self.refuse:
            raise invalid(self.refuse, "bad")
        n, b = head.num_tokens, head.batch
        qsl = torch.arange(b + 1, dtype=torch.int32)
        qsl[-1] = n
        return ProposeInputs(
            torch.full((n,), self.tag, dtype=torch.int64), torch.arange(n), torch.zeros(n, 3, dtype=self.dtype),
            torch.zeros(b, dtype=torch.int64), qsl, torch.ones(b, dtype=torch.int32),
            [torch.zeros(b, 2, dtype=torch.int32)], [torch.zeros(n, dtype=torch.int64)])

    def fused_drafts(self, head, rows):
        self.drafts = rows.clone()

    def fused_stamps(self, started, queued):
        assert started <= queued

    def fused_reply(self, head):
        return f"fused {self.tag}: {self.drafts[:, 0].tolist()}"


def _steps(engine) -> BoundSteps:
    metrics = SimpleNamespace(bound_fused_calls=_Count(), bound_fused_steps=_Count())
    return BoundSteps(SimpleNamespace(engine=engine, metrics=metrics))


class _Count:
    def __init__(self):
        self.value = 0

    def inc(self, n: int = 1):
        self.value += n


def _head(n: int, b: int):
    return SimpleNamespace(num_tokens=n, batch=b)


def _serve_all(steps: BoundSteps, tickets) -> list:
    """The first ticket's serve (it takes every pending one), then each owner's: answers or refusals."""
    out = []
    for t in tickets:
        try:
            out.append(steps.serve(t))
        except DrafterError as exc:
            out.append(exc)
    return out


def test_one_step_alone_runs_its_own_step():
    engine, s = Engine(), Session(1)
    steps = _steps(engine)
    assert steps.run(s, _head(5, 1), 0, lambda fn, t: fn(t)) == "alone 1"
    assert s.alone == 1 and engine.calls == [] and steps.pending() == 0 and steps.fused_calls == 0


def test_pending_steps_share_one_call_at_the_smallest_captured_sizes_and_get_their_own_rows():
    engine = Engine()
    steps = _steps(engine)
    sessions = [Session(1), Session(2), Session(3)]
    tickets = [steps.enter(s, _head(n, b), 0) for s, (n, b) in zip(sessions, [(3, 1), (4, 2), (2, 1)])]
    answers = _serve_all(steps, tickets)
    assert engine.calls == [(4, 9, 4, 16)], "one call, padded to the captured (batch 4, tokens 16)"
    assert answers == ["fused 1: [1]", "fused 2: [2, 2]", "fused 3: [3]"]
    assert (steps.fused_calls, steps.fused_steps) == (1, 3) and steps.core.metrics.bound_fused_steps.value == 3
    assert steps.pending() == 0


def test_steps_past_the_largest_captured_sizes_split_and_kinds_do_not_mix():
    engine = Engine()
    steps = _steps(engine)
    big = [Session(1), Session(2), Session(3)]  # 10 + 10 tokens > 16: the second opens a group of its own
    half = Session(4, dtype=torch.bfloat16)  # another hidden dtype: a kind of its own
    tickets = [steps.enter(s, _head(10, 2), 0) for s in big[:2]] + [steps.enter(half, _head(2, 1), 0),
                                                                    steps.enter(big[2], _head(5, 1), 0)]
    answers = _serve_all(steps, tickets)
    assert engine.calls == [(3, 15, 4, 16)], "the second and the last float32 step fused; the rest alone"
    assert answers == ["alone 1", "fused 2: [2, 2]", "alone 4", "fused 3: [3]"]
    assert (steps.fused_calls, steps.fused_steps) == (1, 2)


def test_a_refused_step_keeps_its_refusal_and_the_others_are_served():
    engine = Engine()
    steps = _steps(engine)
    sessions = [Session(1), Session(2, refuse="slot_mappings[0]"), Session(3)]
    tickets = [steps.enter(s, _head(3, 1), 0) for s in sessions]
    answers = _serve_all(steps, tickets)
    assert answers[0] == "fused 1: [1]" and answers[2] == "fused 3: [3]"
    assert isinstance(answers[1], DrafterError) and answers[1].field == "slot_mappings[0]"
    assert engine.calls == [(2, 6, 2, 8)] and (steps.fused_calls, steps.fused_steps) == (1, 2)


def test_a_step_whose_engine_take_failed_is_not_left_pending():
    steps = _steps(Engine())

    def shut_down(fn, t):
        raise RuntimeError("cannot schedule new futures after shutdown")

    with pytest.raises(RuntimeError):
        steps.run(Session(1), _head(3, 1), 0, shut_down)
    assert steps.pending() == 0
