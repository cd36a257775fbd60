"""Stage probes of the engine thread: absent from the class while off, every stage marked in order once on."""

from __future__ import annotations

import concurrent.futures

import torch

from drafter.service.batching.queue import Pending
from drafter.service.batching.runner import EngineRunner
from drafter.service.sessions import Session
from drafter.wire import probes
from drafter.wire.records import DraftOutput
from tests.support.requests import request


class _Engine:
    class config:  # noqa: N801 - the attributes EngineRunner reads
        max_num_seqs, max_num_batched_tokens, torch_dtype, kv_groups = 8, 64, torch.float32, (None,)

    device = torch.device("cpu")
    limits = None

    def draft(self, inp, **options):
        b = inp.next_token_ids.shape[0]
        return DraftOutput(torch.zeros(b, 3, dtype=torch.int64), None, b, inp.target_token_ids.shape[0])


def _pending(probe):
    kw = {"target_token_ids": torch.zeros(2, dtype=torch.int64), "target_hidden_states": torch.zeros(2, 4),
          "next_token_ids": torch.zeros(1, dtype=torch.int64), "query_start_loc": torch.tensor([0, 2]),
          "block_tables": [torch.zeros(1, 1, dtype=torch.int32)], "slot_mappings": [torch.zeros(2, dtype=torch.int64)]}
    return Pending(Session("x", "c", (0,), (64,), (16,), 96, 8, 64, torch.float32),
                   request(kw, "x", 0, 1, probe=probe), concurrent.futures.Future())


def test_staged_steps_are_plain_methods_while_off_and_mark_in_order_when_on():
    was_on = probes.RECORDER is not None
    probes.disable()
    try:
        assert not hasattr(EngineRunner._offsets, "__wrapped__"), "off: the class holds the plain method"
        probes.enable()
        assert EngineRunner._offsets.__wrapped__ is not None
        probe = probes.Probe("test")
        result = EngineRunner(_Engine()).run_batch([_pending(probe)])[0]
        assert result.draft_token_ids.shape == (1, 3)
        assert [name for name, _ in probe.marks] == ["start", "handoff_in", "session_offsets", "finite_check",
                                                     "prepare", "engine"]
        probes.disable()
        assert not hasattr(EngineRunner._offsets, "__wrapped__")
    finally:
        if was_on:
            probes.enable()
