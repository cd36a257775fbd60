"""extract_hidden_states: every token's aux states are stored by slot and can be exported."""

from __future__ import annotations

import torch

from tests.support.engines import build_engine
from tests.support.scenario import Scenario


def test_store_and_export_follow_the_slot_mapping(tiny_root):
    engine = build_engine(tiny_root, "extract_hidden_states", max_model_len=64, num_blocks=16)
    width = engine.spec.hidden_input_width
    scn = Scenario(block_sizes=engine.limits.block_sizes, num_blocks=engine.limits.num_blocks,
                   vocab_size=engine.spec.vocab_size, hidden_width=width, k=1, max_model_len=64, seed=5)
    history: dict[int, dict[int, torch.Tensor]] = {0: {}, 1: {}}
    for plan in ([(0, 7, 0), (1, 20, 0)], [(0, 2, 1), (1, 2, 0)], [(1, 2, 0), (0, 2, 0)]):
        call = scn.call(plan)
        out = engine.propose(**call.kwargs)
        assert torch.equal(out.draft_token_ids[:, 0], call.kwargs["next_token_ids"].long())
        for rid, (pos, _, hidden, _) in zip(call.request_ids, call.rows):
            for p, h in zip(pos.tolist(), hidden):
                history[rid][p] = h
    for rid, table_row in ((0, scn.requests[0].blocks[0]), (1, scn.requests[1].blocks[0])):
        n = max(history[rid]) + 1
        exported = engine.export_hidden_states(torch.tensor(table_row), n)
        assert exported.shape == (n, len(engine.spec.aux_layer_ids), engine.spec.target_width)
        expected = torch.stack([history[rid][p] for p in range(n)]).view_as(exported)
        assert torch.equal(exported, expected)
