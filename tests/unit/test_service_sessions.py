"""Session table: layout checks with the right codes, contiguous pools, limits, block-id shifting."""

from __future__ import annotations

import pytest
import torch

from drafter.wire import schema
from drafter.wire.errors import Code, DrafterError
from drafter.service.sessions import (
    BlockAllocator, EngineDescription, SessionTable, check_call, offset_inputs)
from drafter.wire.records import ProposeRequest
from tests.support.requests import request

ENG = EngineDescription(
    method="eagle3", num_speculative_tokens=3, speculative_token_tree=None, dtype="float32", hidden_size=64,
    num_aux_layers=3, aux_layer_ids=(1, 2, 3), hidden_width=192, vocab_size=512, max_model_len=96,
    max_num_seqs=8, max_num_batched_tokens=256, block_sizes=(16, 8), pool_blocks=(100, 60),
    capture_sizes=(1, 2, 4, 8), token_capture_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), max_message_bytes=80_000)


def layout(**over) -> schema.AttachRequest:
    base = dict(protocol_version=1, method="eagle3", num_speculative_tokens=3, hidden_dtype="float32", hidden_size=64,
                num_aux_layers=3, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=128,
                kv_groups=[schema.KVGroup(block_size=16, num_blocks=30), schema.KVGroup(block_size=8, num_blocks=20)])
    base.update(over)
    return schema.AttachRequest(**base)


@pytest.mark.parametrize("over,code,field", [
    (dict(protocol_version=2), Code.FAILED_PRECONDITION, "protocol_version"),
    (dict(method="mtp"), Code.FAILED_PRECONDITION, "method"),
    (dict(num_speculative_tokens=2), Code.FAILED_PRECONDITION, "num_speculative_tokens"),
    (dict(speculative_token_tree=[schema.TreePath(ranks=[0])]), Code.FAILED_PRECONDITION, "speculative_token_tree"),
    (dict(hidden_dtype="int32"), Code.INVALID_ARGUMENT, "hidden_dtype"),
    (dict(hidden_dtype="float64"), Code.INVALID_ARGUMENT, "hidden_dtype"),
    (dict(hidden_size=32), Code.FAILED_PRECONDITION, "hidden_size"),
    (dict(num_aux_layers=0), Code.FAILED_PRECONDITION, "num_aux_layers"),
    (dict(max_model_len=128), Code.FAILED_PRECONDITION, "max_model_len"),
    (dict(max_num_seqs=0), Code.INVALID_ARGUMENT, "max_num_seqs"),
    (dict(max_num_seqs=9), Code.FAILED_PRECONDITION, "max_num_seqs"),
    (dict(max_num_batched_tokens=257), Code.FAILED_PRECONDITION, "max_num_batched_tokens"),
    (dict(kv_groups=[schema.KVGroup(block_size=16, num_blocks=30)]), Code.FAILED_PRECONDITION, "kv_groups"),
    (dict(kv_groups=[schema.KVGroup(block_size=16, num_blocks=3), schema.KVGroup(block_size=16, num_blocks=3)]),
     Code.FAILED_PRECONDITION, "kv_groups[1].block_size"),
    (dict(kv_groups=[schema.KVGroup(block_size=16, num_blocks=0), schema.KVGroup(block_size=8, num_blocks=3)]),
     Code.INVALID_ARGUMENT, "kv_groups[0].num_blocks"),
    (dict(kv_groups=[schema.KVGroup(block_size=16, num_blocks=101), schema.KVGroup(block_size=8, num_blocks=3)]),
     Code.RESOURCE_EXHAUSTED, "kv_groups[0].num_blocks"),
])
def test_attach_refusals_name_the_field(over, code, field):
    table = SessionTable(ENG, max_sessions=4)
    with pytest.raises(DrafterError) as e:
        table.attach(layout(**over))
    assert (e.value.code, e.value.field) == (code, field)
    assert table.free_blocks() == [100, 60], "a refused attach must not keep blocks"


def test_sessions_get_disjoint_ranges_and_the_pool_refuses_when_full():
    table = SessionTable(ENG, max_sessions=8)
    a, b, c = (table.attach(layout()) for _ in range(3))
    assert [s.bases for s in (a, b, c)] == [(0, 0), (30, 20), (60, 40)]
    with pytest.raises(DrafterError) as e:  # group 0 has room for 10, group 1 for nothing
        table.attach(layout(kv_groups=[schema.KVGroup(block_size=16, num_blocks=10),
                                       schema.KVGroup(block_size=8, num_blocks=20)]))
    assert (e.value.code, e.value.field) == (Code.RESOURCE_EXHAUSTED, "kv_groups[1].num_blocks")
    assert table.free_blocks() == [10, 0], "group 0's blocks went back when group 1 refused"
    table.release(table.detach(b.id))
    d = table.attach(layout())
    assert d.bases == (30, 20), "first fit reuses the released range"
    with pytest.raises(DrafterError) as e:
        table.get(b.id)
    assert (e.value.code, e.value.field) == (Code.NOT_FOUND, "session_id")


def test_max_sessions():
    table = SessionTable(ENG, max_sessions=1)
    table.attach(layout(kv_groups=[schema.KVGroup(block_size=16, num_blocks=1), schema.KVGroup(block_size=8,
                                                                                               num_blocks=1)]))
    with pytest.raises(DrafterError) as e:
        table.attach(layout())
    assert (e.value.code, e.value.field) == (Code.RESOURCE_EXHAUSTED, "session")


def test_allocator_coalesces():
    a = BlockAllocator(10)
    x, y, _ = a.allocate(3), a.allocate(3), a.allocate(3)
    a.release(y, 3)
    a.release(x, 3)
    assert a.free == [(0, 6), (9, 1)]
    assert a.allocate(6) == 0 and a.allocate(2) is None


def _call(**over) -> ProposeRequest:
    kw = dict(
        target_token_ids=torch.tensor([1, 2, 3]), target_positions=torch.tensor([0, 1, 2]),
        target_hidden_states=torch.zeros(3, 192), next_token_ids=torch.tensor([4]),
        query_start_loc=torch.tensor([0, 3]), seq_lens=torch.tensor([3]),
        block_tables=[torch.tensor([[29, 0]]), torch.tensor([[19, 3, 0]])],
        slot_mappings=[torch.tensor([464, 465, -1]), torch.tensor([152, 153, 154])])
    call_over = {k: over.pop(k) for k in ("accepted_counts", "return_probs", "batch_padded", "tokens_padded")
                 if k in over}
    kw.update(over)
    return request(kw, "s", 1, 1, **call_over)


@pytest.mark.parametrize("over,field", [
    (dict(next_token_ids=torch.tensor([1] * 5), seq_lens=torch.tensor([3] * 5)), "next_token_ids"),
    (dict(target_token_ids=torch.zeros(129, dtype=torch.long)), "target_token_ids"),
    (dict(target_hidden_states=torch.zeros(3, 192, dtype=torch.float16)), "target_hidden_states"),
    (dict(target_positions=torch.tensor([0, 1, 96])), "target_positions"),
    (dict(seq_lens=torch.tensor([97])), "seq_lens"),
    (dict(block_tables=[torch.tensor([[30, 0]]), torch.tensor([[1]])]), "block_tables[0]"),
    (dict(block_tables=[torch.tensor([[0, -1]]), torch.tensor([[1]])]), "block_tables[0]"),
    (dict(block_tables=[torch.tensor([[0]]), torch.tensor([[20]])]), "block_tables[1]"),
    (dict(slot_mappings=[torch.tensor([480, 0, 0]), torch.tensor([0, 0, 0])]), "slot_mappings[0]"),
    (dict(slot_mappings=[torch.tensor([0, 0, 0]), torch.tensor([-2, 0, 0])]), "slot_mappings[1]"),
    (dict(block_tables=[torch.tensor([[0]])]), "block_tables"),
    (dict(accepted_counts=torch.tensor([4])), "accepted_counts"),
    (dict(accepted_counts=torch.tensor([1, 1])), "accepted_counts"),
    (dict(batch_padded=9), "batch_padded"),
    (dict(tokens_padded=2), "tokens_padded"),
    (dict(return_probs=True, next_token_ids=torch.tensor([1] * 4), seq_lens=torch.tensor([3] * 4)), "return_probs"),
])
def test_session_limits_name_the_field(over, field):
    table = SessionTable(ENG, max_sessions=4)
    s = table.attach(layout())
    with pytest.raises(DrafterError) as e:
        check_call(s, _call(**over), ENG)
    assert (e.value.code, e.value.field) == (Code.INVALID_ARGUMENT, field)


def test_offsets_move_ids_into_the_sessions_range_and_keep_padding_slots():
    table = SessionTable(ENG, max_sessions=4)
    table.attach(layout())
    s = table.attach(layout())
    call = _call()
    check_call(s, call, ENG)
    out = offset_inputs(s, call.inputs)
    assert out.block_tables[0].tolist() == [[59, 30]] and out.block_tables[1].tolist() == [[39, 23, 20]]
    assert out.slot_mappings[0].tolist() == [464 + 30 * 16, 465 + 30 * 16, -1]
    assert out.slot_mappings[1].tolist() == [152 + 20 * 8, 153 + 160, 154 + 160]
    assert call.inputs.block_tables[0].tolist() == [[29, 0]], "the request's own tensors stay untouched"


def test_probabilities_that_fit_are_allowed():
    table = SessionTable(ENG, max_sessions=4)
    s = table.attach(layout())
    check_call(s, _call(return_probs=True), ENG)  # 1 x 3 x 512 float32 + headroom < 80 kB
