"""EAGLE-3's aux hidden states written straight into the bound buffer (drafter_vllm.hidden, what
Model Runner V2's stand-in does; BoundTransport.hidden_rows): the ring's shipped bytes equal
today's (torch.cat, then the transport's copy), the transport's copy of the hidden states has
nothing left to do, and hidden_rows offers a buffer only where the next bound step fills from it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from coordinator.session import SessionSpec
from coordinator.transport.bound_client import BoundRing
from coordinator.transport.bound_transport import BoundConfig, BoundTransport, fill, session_buffers
from drafter.engine.config import KVGroupSpec
from drafter.wire import bound as wb
from drafter.wire.records import ProposeRequest
from drafter_vllm.hidden import bound_hidden_rows, join_layers
from tests.support.scenario import Scenario

K, MML, BATCH, TOKENS, BLOCK, HIDDEN, LAYERS = 3, 48, 4, 32, 16, 8, 3
SPEC = SessionSpec(method="eagle3", num_speculative_tokens=K, hidden_size=HIDDEN, num_aux_layers=LAYERS,
                   max_model_len=MML, max_num_seqs=BATCH, max_num_batched_tokens=TOKENS, kv_groups=(KVGroupSpec(BLOCK, 16),),
                   dtype="bfloat16")
INFO = SimpleNamespace(session_id="s", epoch="7", max_num_seqs=BATCH, max_num_batched_tokens=TOKENS)


def _ring() -> BoundRing:
    return BoundRing(session_buffers(SPEC, INFO, TOKENS, 0, 0))


def _step():
    """A step's keywords and MRv2's per-layer aux states ([>= num_tokens, HIDDEN] each, longer than the step)."""
    sc = Scenario(block_sizes=[BLOCK], num_blocks=[16], vocab_size=100, hidden_width=HIDDEN * LAYERS, k=K,
                  max_model_len=MML, seed=5)
    kwargs = dict(sc.call([(0, 6, 0), (1, 7, 0)]).kwargs)
    n = kwargs["target_token_ids"].shape[0]
    g = torch.Generator().manual_seed(1)
    layers = [torch.randn(n + 5, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    return kwargs, layers, n


def test_the_layers_written_into_the_ring_ship_the_bytes_torch_cat_did():
    kwargs, layers, n = _step()
    today, direct = _ring(), _ring()
    fill(today.views, ProposeRequest.from_keywords(**{**kwargs, "target_hidden_states": join_layers(layers, n)}).inputs)
    rows = direct.views[wb.HIDDEN][:n]
    hidden = join_layers(layers, n, rows)
    assert hidden.data_ptr() == direct.views[wb.HIDDEN].data_ptr(), "the step's hidden states are the ring's rows"
    before = direct.slab.clone()
    req = ProposeRequest.from_keywords(**{**kwargs, "target_hidden_states": hidden})
    n_filled, _ = fill(direct.views, req.inputs)
    nbytes = today.step_bytes(n_filled)
    assert torch.equal(direct.slab[:nbytes], today.slab[:nbytes])
    hid = next(s for s in direct.slots if s.name == wb.HIDDEN)
    assert torch.equal(before[hid.offset:nbytes], direct.slab[hid.offset:nbytes]), "fill left the rows as written"


def test_join_layers_refuses_a_buffer_of_another_shape():
    _, layers, n = _step()
    with pytest.raises(ValueError):
        join_layers(layers, n, torch.zeros(n, HIDDEN * LAYERS + 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        join_layers(layers, n, torch.zeros(n - 1, HIDDEN * LAYERS, dtype=torch.bfloat16))


def _transport(alive: bool) -> BoundTransport:
    inner = SimpleNamespace(client=SimpleNamespace(endpoint="tcp://127.0.0.1:1"), name="zmq")
    t = BoundTransport(inner, SPEC, BoundConfig())
    t.ring = _ring()
    t.link = SimpleNamespace(alive=alive, close=lambda: None)  # a host-ring link (not a DeviceLink)
    return t


def test_hidden_rows_only_where_the_next_bound_step_fills_from_it():
    t = _transport(alive=True)
    cpu, width = torch.device("cpu"), HIDDEN * LAYERS
    rows = t.hidden_rows(13, width, torch.bfloat16, cpu)
    assert rows is not None and rows.shape == (13, width) and rows.data_ptr() == t.ring.views[wb.HIDDEN].data_ptr()
    assert t.hidden_rows(13, width, torch.float32, cpu) is None, "another dtype"
    assert t.hidden_rows(13, width + 1, torch.bfloat16, cpu) is None, "another width"
    assert t.hidden_rows(TOKENS + 1, width, torch.bfloat16, cpu) is None, "more rows than the ring"
    source = SimpleNamespace(transports={"ep": t}, endpoint="ep")
    assert bound_hidden_rows(source, 13, width, torch.bfloat16, cpu).data_ptr() == rows.data_ptr()
    assert bound_hidden_rows(None, 13, width, torch.bfloat16, cpu) is None, "no source yet"
    assert _transport(alive=False).hidden_rows(13, width, torch.bfloat16, cpu) is None, "no live binding"
