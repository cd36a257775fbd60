"""A bound step sent without waiting (pre-drafts verified instead of its drafts) still reports a
step the GPU guard masked: settle(), before the next step writes the buffers, raises
INVALID_ARGUMENT naming the field its error word names, as an awaited step does at its own."""

from __future__ import annotations

import pytest
import torch

from coordinator.transport.bound_ipc import DeviceLink
from drafter.wire import bound as wb
from drafter.wire.errors import Code, DrafterError


def _link(word: int) -> DeviceLink:
    """A DeviceLink whose unawaited step 7 came back with `word` in its output's last slot (the
    socket parts stubbed: what settle() does with the word is under test)."""
    link = object.__new__(DeviceLink)
    link.device, link.groups = torch.device("cpu"), 1
    link.output = torch.zeros(4 * 3 + 1, dtype=torch.int64)  # [max_batch * width + 1]: drafts, error word
    link.output[-1] = word
    link._host_word = None
    link._unawaited = 7
    link.replies = []
    link._reply = lambda step, timeout_s: link.replies.append(step)
    link._after_reply = lambda timeout_s: None
    link._arrive = lambda: None
    return link


def test_settle_names_the_field_a_masked_unawaited_step_set():
    field = "slot_mappings[0]"
    link = _link(1 << wb.guard_fields(1).index(field))
    with pytest.raises(DrafterError) as err:
        link.settle(1.0)
    assert err.value.code == Code.INVALID_ARGUMENT and err.value.field == field
    assert link.replies == [7] and link._unawaited == 0  # the StepDone was read: the next step may go


def test_settle_of_a_clean_step_raises_nothing():
    link = _link(0)
    link.settle(1.0)
    assert link.replies == [7] and link._unawaited == 0
