"""The bound push frame (drafter.wire.predraft.BOUND_PUSH, issue 23): a pushed set round-trips
token for token; no StepDone frame and no doorbell WAKE reads as a push; the frame carries the
unbound push's header type itself (schema.PreDraftPush, whose proto twin test_service_schema
compares field by field), so the bound push has no schema of its own to drift; a frame whose
tensors do not fit is refused naming the field."""

from __future__ import annotations

import msgspec
import pytest
import torch

from drafter.wire import bound as wb
from drafter.wire import doorbell, schema
from drafter.wire.errors import Code, DrafterError
from drafter.wire.predraft import (BOUND_PUSH, PreDrafts, _bound, bound_push_frame, bound_push_from_frame,
                                   is_bound_push, push_to_frames)


def _set(step: int = 7) -> PreDrafts:
    g = torch.Generator().manual_seed(step)
    b, n, k = 3, 2, 4
    return PreDrafts(step, torch.tensor([0, 5, 9]), torch.tensor([11, 30, 7]),
                     torch.randint(0, 500, (b, 3), generator=g), accepted=torch.tensor([[3, 2], [1, -1], [0, 3]]),
                     next_tokens=torch.randint(0, 500, (b, n), generator=g),
                     drafts=torch.randint(0, 500, (b, n, k), generator=g))


def test_a_pushed_set_round_trips():
    pre = _set()
    frame = bound_push_frame(pre, "sess", 4)
    assert is_bound_push(frame) and frame.startswith(BOUND_PUSH)
    got, session, epoch = bound_push_from_frame(frame)
    assert (got.step, session, epoch) == (7, "sess", 4)
    for name in ("block_ids", "positions", "conditioned_on", "accepted", "next_tokens", "drafts"):
        assert torch.equal(getattr(got, name), getattr(pre, name)), name
    assert got.log_probs is None, "token ids only"


def test_no_step_done_or_wake_reads_as_a_push():
    for done in (wb.StepDone(step=1), wb.StepDone(step=2**40, code=3, field="x", message="m", stamps=[1, 2, 3])):
        assert not is_bound_push(wb.encode(done))
    assert not is_bound_push(doorbell.WAKE)
    assert not is_bound_push(b"")


def test_the_push_header_is_the_unbound_push_message():
    cls, _, _ = _bound()
    fields = {f.name: f.type for f in msgspec.inspect.type_info(cls).fields}
    assert isinstance(fields["push"], msgspec.inspect.StructType) and fields["push"].cls is schema.PreDraftPush
    assert schema.MESSAGES["PreDraftPush"] is schema.PreDraftPush  # compared with the proto message elsewhere
    header, _ = push_to_frames(_set(), "s", 1)
    assert isinstance(header, schema.PreDraftPush)


def test_a_frame_that_does_not_fit_is_refused_naming_the_field():
    cls, enc, _ = _bound()
    header, frames = push_to_frames(_set(), "s", 1)
    frames = [bytes(memoryview(f)) for f in frames]
    frames[header.drafts.frame] = frames[header.drafts.frame][:-8]  # one id short
    with pytest.raises(DrafterError) as err:
        bound_push_from_frame(BOUND_PUSH + enc.encode(cls(header, frames)))
    assert err.value.code == Code.INVALID_ARGUMENT and err.value.field == "drafts"
    with pytest.raises(DrafterError) as err:
        bound_push_from_frame(BOUND_PUSH + b"\x92\x01")
    assert err.value.field == "push"


def test_taken_names_its_step_and_is_no_other_frame():
    """The target's TAKEN word (an awaited step's drafts are here) carries the step; no StepHeader,
    StepDone, WAKE or push frame reads as one, and a TAKEN is neither a push nor a header."""
    from drafter.wire.predraft import taken_frame, taken_step

    for step in (1, 7, 2**40):
        frame = taken_frame(step)
        assert taken_step(frame) == step and not is_bound_push(frame)
        with pytest.raises(msgspec.DecodeError):
            wb.STEP_DECODER.decode(frame)
    others = [wb.encode(wb.StepHeader(step=3, num_tokens=4, batch=1)), wb.encode(wb.StepDone(step=3)), doorbell.WAKE,
              bound_push_frame(_set(), "s", 1), b"", taken_frame(3)[:-1]]
    assert all(taken_step(f) is None for f in others)
