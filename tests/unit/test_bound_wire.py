"""The bound-session wire (drafter.wire.bound) and the drafter's once-per-bind layout checks
(drafter.service.bound_sessions.check_layout): both ends must lay the buffers out identically,
the hidden states last, and a bad layout must be refused naming the buffer."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
import torch

from drafter.service.bound_sessions import check_layout, first_bad_field
from drafter.wire import bound as wb
from drafter.wire.errors import Code, DrafterError
from drafter.wire.tensors import DTYPES

WIDTH, TOKENS, BATCH = 24, 32, 4
SESSION = SimpleNamespace(num_blocks=(8,), block_sizes=(16,), max_num_seqs=BATCH, max_num_batched_tokens=TOKENS,
                          max_model_len=48, hidden_dtype=torch.float32)
DESC = SimpleNamespace(hidden_width=WIDTH, vocab_size=100, num_speculative_tokens=3)


def _specs():
    return [wb.BufferSpec("target_token_ids", "int64", [TOKENS]),
            wb.BufferSpec("target_hidden_states", "float32", [TOKENS, WIDTH]),
            wb.BufferSpec("target_positions", "int32", [TOKENS]),
            wb.BufferSpec("next_token_ids", "int64", [BATCH]),
            wb.BufferSpec("query_start_loc", "int32", [BATCH + 1]),
            wb.BufferSpec("seq_lens", "int32", [BATCH]),
            wb.BufferSpec("block_tables[0]", "int32", [BATCH, 3]),
            wb.BufferSpec("slot_mappings[0]", "int64", [TOKENS])]


def _itemsize(d):
    return DTYPES[d].itemsize


def test_layout_is_aligned_hidden_last_and_a_step_ships_only_its_rows():
    slots, total = wb.ring_layout(_specs(), _itemsize)
    assert slots[-1].name == wb.HIDDEN and slots[-1].offset + slots[-1].nbytes == total
    assert all(s.offset % wb.ALIGN == 0 for s in slots)
    ends = sorted((s.offset, s.offset + s.nbytes) for s in slots)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "buffers overlap"
    assert wb.step_bytes(slots, 5) == slots[-1].offset + 5 * WIDTH * 4
    again, _ = wb.ring_layout(msgspec.msgpack.decode(wb.encode(_specs()), type=list[wb.BufferSpec]), _itemsize)
    assert again == slots, "the layout the drafter derives from the wire equals the target's"


def test_records_round_trip_and_refuse_unknown_fields():
    head = wb.StepHeader(step=7, num_tokens=13, batch=3, nbytes=900)
    assert wb.STEP_DECODER.decode(wb.encode(head)) == head
    req = wb.BindRequest(session_id="s", epoch=3, buffers=_specs(), max_batch=BATCH)
    assert wb.BIND_DECODER.decode(wb.encode(req)) == req
    with pytest.raises(msgspec.ValidationError):
        wb.BIND_DECODER.decode(msgspec.msgpack.encode({"session_id": "s", "sneaky": 1}))


@pytest.mark.parametrize("change,field", [
    (lambda b: b + [wb.BufferSpec("block_tables[1]", "int32", [BATCH, 3])], "buffers"),  # one KV group only
    (lambda b: b + [b[0]], "target_token_ids"),
    (lambda b: [x for x in b if x.name != "seq_lens"], "seq_lens"),
    (lambda b: [wb.BufferSpec(x.name, "float32", x.shape) if x.name == "next_token_ids" else x for x in b],
     "next_token_ids"),
    (lambda b: [wb.BufferSpec(x.name, x.dtype, [TOKENS, WIDTH + 1]) if x.name == wb.HIDDEN else x for x in b],
     wb.HIDDEN),
    (lambda b: [wb.BufferSpec(x.name, "bfloat16", x.shape) if x.name == wb.HIDDEN else x for x in b], wb.HIDDEN),
    (lambda b: [wb.BufferSpec(x.name, x.dtype, [BATCH * 3]) if x.name == "block_tables[0]" else x for x in b],
     "block_tables[0]"),
    (lambda b: [wb.BufferSpec(x.name, x.dtype, [0]) if x.name == "seq_lens" else x for x in b], "seq_lens"),
])
def test_a_bad_layout_is_refused_naming_the_buffer(change, field):
    with pytest.raises(DrafterError) as err:
        check_layout(wb.BindRequest(buffers=change(_specs()), max_batch=BATCH), SESSION, DESC)
    assert err.value.code == Code.INVALID_ARGUMENT and err.value.field == field, str(err.value)


def _views():
    slots, total = wb.ring_layout(_specs(), _itemsize)
    ring = torch.zeros(total, dtype=torch.uint8)
    v = {s.name: ring[s.offset:s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape) for s in slots}
    v["query_start_loc"][:3] = torch.tensor([0, 2, 5], dtype=torch.int32)
    v["seq_lens"][:2] = torch.tensor([7, 9], dtype=torch.int32)
    v["slot_mappings[0]"][:5] = torch.tensor([3, 4, 20, 21, -1])
    return v


@pytest.mark.parametrize("field,write", [
    ("target_token_ids", lambda v: v["target_token_ids"].__setitem__(4, 100)),
    ("target_positions", lambda v: v["target_positions"].__setitem__(0, 48)),
    (wb.HIDDEN, lambda v: v[wb.HIDDEN].__setitem__((3, 5), float("inf"))),
    ("query_start_loc", lambda v: v["query_start_loc"].__setitem__(2, 6)),
    ("seq_lens", lambda v: v["seq_lens"].__setitem__(1, 0)),
    ("block_tables[0]", lambda v: v["block_tables[0]"].__setitem__((1, 2), 8)),
    ("slot_mappings[0]", lambda v: v["slot_mappings[0]"].__setitem__(2, 8 * 16)),
    ("slot_mappings[0]", lambda v: v["slot_mappings[0]"].__setitem__(2, -2)),
])
def test_the_step_checks_name_the_first_bad_field_and_look_only_at_the_step_rows(field, write):
    v = _views()
    assert first_bad_field(v, 5, 2, SESSION, DESC) is None
    v["target_positions"][5:] = 10_000  # rows past the step: never read, never checked
    v["block_tables[0]"][2:] = -7
    assert first_bad_field(v, 5, 2, SESSION, DESC) is None
    write(v)
    assert first_bad_field(v, 5, 2, SESSION, DESC) == field


def test_a_channel_wait_is_bounded_and_the_handshake_pairs_the_ranks():
    """drafter.wire.bound_channel: settle() gives up at its deadline (a work that never completes,
    on the GPU's polling path and on gloo's blocking one) instead of hanging; the handshake carries
    the target's word to the drafter over a real two-rank gloo group."""
    import datetime
    import threading
    import time

    import torch.distributed as dist

    from drafter.wire import bound_channel as bc

    class Never:  # a work whose transfer never completes
        def is_completed(self):
            return False

    with pytest.raises(TimeoutError):
        bc.settle(Never(), time.monotonic() + 0.05, "a stuck transfer")
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=30)
    groups: dict = {}
    joined = [threading.Thread(target=lambda r=r: groups.__setitem__(r, bc.open_group(bc.GLOO, store, "t", r, timeout)))
              for r in (bc.TARGET_RANK, bc.DRAFTER_RANK)]
    for t in joined:
        t.start()
    for t in joined:
        t.join(60)
    assert set(groups) == {bc.TARGET_RANK, bc.DRAFTER_RANK}
    sender = threading.Thread(target=bc.handshake, args=(groups[bc.TARGET_RANK], bc.TARGET_RANK, torch.device("cpu"),
                                                         time.monotonic() + 30))
    sender.start()
    bc.handshake(groups[bc.DRAFTER_RANK], bc.DRAFTER_RANK, torch.device("cpu"), time.monotonic() + 30)
    sender.join(60)
    word = torch.zeros(1, dtype=torch.int64)  # [1]: nothing is ever sent for this recv
    with pytest.raises(TimeoutError):
        bc.settle(groups[bc.DRAFTER_RANK].recv([word], bc.TARGET_RANK, 0), time.monotonic() + 0.2, "a lost step",
                  on_gpu=False)
    for g in groups.values():
        bc.close_group(g)
