"""The tensor-parallel step message: tensors of any dtype, empty ones and absent ones survive the one-buffer
packing bit for bit, and a draft step's ProposeInputs is rebuilt field for field on the worker's side."""

from __future__ import annotations

import torch

from drafter.service.tp.channel import ALIGN, Header, pack, unpack
from drafter.service.tp.steps import DraftOptions, draft_inputs, draft_tensors
from drafter.wire.records import ProposeInputs


def test_pack_round_trips_every_dtype_and_absent_slots():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-5, 5, (7,), generator=g, dtype=torch.int32), None,
               torch.randn(3, 5, generator=g).to(torch.bfloat16), torch.empty(0, dtype=torch.int64),
               torch.randn(2, 3, generator=g).t(),  # not contiguous
               torch.tensor([True, False, True]), torch.randint(0, 9, (3, 4), generator=g)]
    specs, buf = pack(tensors, torch.device("cpu"))
    assert buf.numel() == Header("x", None, specs).payload_bytes and buf.numel() % ALIGN == 0
    back = unpack(specs, buf.clone())
    for t, b in zip(tensors, back):
        assert (t is None and b is None) or (b.dtype == t.dtype and torch.equal(b, t))


def test_a_draft_step_rebuilds_its_inputs():
    inp = ProposeInputs(
        target_token_ids=torch.tensor([5, 6, 7], dtype=torch.int32), target_positions=torch.tensor([0, 1, 2]),
        target_hidden_states=torch.randn(3, 4), next_token_ids=torch.tensor([9], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32), seq_lens=torch.tensor([3], dtype=torch.int32),
        block_tables=[torch.tensor([[4]], dtype=torch.int32), torch.tensor([[1, 2]], dtype=torch.int32)],
        slot_mappings=[torch.tensor([64, 65, 66]), torch.tensor([8, 9, 10])],
        num_rejected_tokens=torch.tensor([1], dtype=torch.int32))
    opts = DraftOptions(groups=2, return_probs=True, return_logits=False, batch_padded=2, tokens_padded=4)
    specs, buf = pack(draft_tensors(inp), torch.device("cpu"))
    back = draft_inputs(opts, unpack(specs, buf))
    for name in ("target_token_ids", "target_positions", "target_hidden_states", "next_token_ids", "query_start_loc",
                 "seq_lens", "num_rejected_tokens"):
        assert torch.equal(getattr(back, name), getattr(inp, name)), name
    assert back.token_indices_to_sample is None and back.temperatures is None
    assert all(torch.equal(a, b) for a, b in zip(back.block_tables + back.slot_mappings,
                                                   inp.block_tables + inp.slot_mappings))
    assert len(back.block_tables) == len(back.slot_mappings) == 2
