"""Malformed propose calls fail with the field named, and the KV pool stays as it was."""

from __future__ import annotations

import pytest
import torch

from drafter.wire.errors import InvalidInput
from tests.support.engines import build_engine
from tests.support.scenario import Scenario

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def setup(tiny_root):
    engine = build_engine(tiny_root, "eagle-2groups", k=3, max_model_len=MAX_MODEL_LEN, num_blocks=32)
    scn = Scenario(block_sizes=engine.limits.block_sizes, num_blocks=engine.limits.num_blocks,
                   vocab_size=engine.spec.vocab_size, hidden_width=engine.spec.hidden_input_width, k=3,
                   max_model_len=MAX_MODEL_LEN, seed=3)
    engine.propose(**scn.call([(0, 10, 0), (1, 6, 0)]).kwargs)  # some state worth protecting
    good = scn.call([(0, 4, 1), (1, 4, 0)]).kwargs
    return engine, good


def _mutations(good):
    n = good["target_token_ids"].shape[0]
    yield "target_token_ids", dict(target_token_ids=good["target_token_ids"].float())
    yield "target_positions", dict(target_positions=good["target_positions"][:-1])
    yield "target_positions", dict(target_positions=good["target_positions"][None])
    yield "target_hidden_states", dict(target_hidden_states=good["target_hidden_states"][:, :-1])
    yield "target_hidden_states", dict(target_hidden_states=good["target_hidden_states"].long())
    yield "query_start_loc", dict(query_start_loc=torch.tensor([0, 4, n - 1], dtype=torch.int32))
    yield "query_start_loc", dict(query_start_loc=torch.tensor([0, 0, n], dtype=torch.int32))
    yield "block_tables[0]", dict(block_tables=[good["block_tables"][0] + 1000, good["block_tables"][1]])
    yield "block_tables[1]", dict(block_tables=[good["block_tables"][0], good["block_tables"][1] - 2000])
    yield "block_tables", dict(block_tables=[good["block_tables"][0]])
    bad_slots = good["slot_mappings"][0].clone()
    bad_slots[0] += 1
    yield "slot_mappings[0]", dict(slot_mappings=[bad_slots, good["slot_mappings"][1]])
    far = good["target_positions"].clone()
    far[:] = MAX_MODEL_LEN + 5
    yield "target_positions", dict(target_positions=far)
    yield "seq_lens", dict(seq_lens=good["seq_lens"] + MAX_MODEL_LEN)
    yield "seq_lens", dict(seq_lens=torch.ones_like(good["seq_lens"]))
    big = good["target_token_ids"].clone()
    big[1] = 10 ** 6
    yield "target_token_ids", dict(target_token_ids=big)
    yield "next_token_ids", dict(next_token_ids=good["next_token_ids"] - 10 ** 6)
    yield "num_rejected_tokens", dict(num_rejected_tokens=torch.tensor([4, 0], dtype=torch.int32))
    yield "token_indices_to_sample", dict(token_indices_to_sample=torch.tensor([7, 7], dtype=torch.int32))
    yield "temperatures", dict(temperatures=torch.tensor([float("nan"), 1.0]))
    yield "next_token_ids", dict(next_token_ids=good["next_token_ids"].tolist())


def test_each_bad_field_is_named_and_kv_untouched(setup):
    engine, good = setup
    reference = engine.kv_snapshot()
    for field, change in _mutations(good):
        with pytest.raises(InvalidInput) as err:
            engine.propose(**{**good, **change})
        assert err.value.field == field, f"{change.keys()}: got {err.value}"
        for before, after in zip(reference, engine.kv_snapshot()):
            assert torch.equal(before, after), f"bad {field} changed the KV pool"
