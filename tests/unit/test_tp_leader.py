"""The leader's engine (TPEngine) in one process, its workers' channel recorded: a refused call sends
nothing; a call is sent with the padded sizes rank 0 runs (unpadded drafter batch: counted after the
rejected tokens are dropped, as one process counts them); a worker rebuilding the recorded step
drafts what the leader drafts; a session's block wipe is sent too."""

from __future__ import annotations

import pytest
import torch

from drafter.service.tp.channel import DRAFT, ZERO_BLOCKS
from drafter.service.tp.leader import TPEngine
from drafter.service.tp.steps import draft_inputs
from drafter.wire.errors import InvalidInput
from tests.support.engines import build_engine
from tests.support.scenario import Scenario


class Recorder:
    """A LeaderChannel stand-in: what would go to the workers."""

    def __init__(self):
        self.sent = []

    def send(self, op, options=None, tensors=()):
        self.sent.append((op, options, [None if t is None else t.clone() for t in tensors]))


def _engine(root, padded: bool):
    return build_engine(root, "eagle3", padded_drafter_batch=padded)


def _call(engine, seed: int = 3):
    scn = Scenario(block_sizes=engine.limits.block_sizes, num_blocks=(64,), vocab_size=engine.spec.vocab_size,
                   hidden_width=engine.spec.hidden_input_width, k=3, max_model_len=96, seed=seed)
    scn.call([(0, 9, 0), (1, 5, 0)])
    # 9 rows, 8 once the rejected one is dropped: the unpadded path pads to 8, not 16
    return scn.call([(0, 5, 1), (1, 4, 0)], padded=False).kwargs


@pytest.mark.parametrize("padded", [True, False])
def test_a_step_is_sent_as_rank_0_runs_it_and_a_worker_drafts_the_same(tiny_root, padded):
    leader, alone, worker = _engine(tiny_root, padded), _engine(tiny_root, padded), _engine(tiny_root, padded)
    channel = Recorder()
    tp = TPEngine(leader, channel, [], 1)
    out = tp.propose(**_call(leader))
    ref = alone.propose(**_call(alone))
    assert torch.equal(out.draft_token_ids, ref.draft_token_ids)
    assert (out.batch_padded, out.tokens_padded) == (ref.batch_padded, ref.tokens_padded)
    [(op, opts, tensors)] = channel.sent
    assert op == DRAFT and (opts.batch_padded, opts.tokens_padded) == (ref.batch_padded, ref.tokens_padded)
    mine = worker.draft(draft_inputs(opts, tensors), batch_padded=opts.batch_padded,
                        tokens_padded=opts.tokens_padded, validate=False)
    assert torch.equal(mine.draft_token_ids, out.draft_token_ids)


def test_a_refused_call_reaches_no_worker_and_a_wipe_does(tiny_root):
    channel = Recorder()
    tp = TPEngine(_engine(tiny_root, True), channel, [], 1)
    bad = _call(tp.engine)
    bad["seq_lens"] = bad["seq_lens"] + 1000
    with pytest.raises(InvalidInput):
        tp.propose(**bad)
    assert channel.sent == []
    tp.kv.zero_blocks(0, torch.tensor([3, 4]))
    [(op, wipe, [ids])] = channel.sent
    assert op == ZERO_BLOCKS and wipe.group == 0 and ids.tolist() == [3, 4]
