"""DraftEngine's eager propose path (StaticBuffers + Proposer) over a DeepSeek MTP head and its MLA
caches, for tests that run before (or beside) the engine's own deepseek_mtp wiring, and the
call plans those tests drive it with."""

from __future__ import annotations

import torch

from drafter.engine.buffers import StaticBuffers
from drafter.engine.engine import drop_rejected_tokens
from drafter.wire.records import ProposeInputs
from drafter.models.deepseek_v3 import kv_cache_shape
from drafter.engine.proposer import Proposer

MAX_MODEL_LEN = 96
BLOCK_SIZE = 16
NUM_BLOCKS = 64


class EagerMTPEngine:
    """Padded beyond every call's sizes (3 extra token rows, 1 extra request); greedy chains, or a
    greedy tree when given one."""

    def __init__(self, head, k: int, tree: tuple[tuple[int, ...], ...] | None = None):
        self.head = head
        self.tree = tree
        self.caches = [torch.zeros(kv_cache_shape(s, NUM_BLOCKS, BLOCK_SIZE)) for s in head.config.layers]
        span = MAX_MODEL_LEN + (len(tree) if tree else 0)
        self.buf = StaticBuffers(256, 8, head.config.hidden_size, (-(-span // BLOCK_SIZE),), (BLOCK_SIZE,),
                                 torch.device("cpu"), torch.float32)
        self.proposer = Proposer(head, self.caches, None, k, MAX_MODEL_LEN, tree)

    @torch.inference_mode()
    def propose(self, kwargs: dict, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:  # [b, k], [b, k, vocab]
        inp = ProposeInputs(**{k: v for k, v in kwargs.items() if k not in ("block_tables", "slot_mappings")},
                            block_tables=list(kwargs["block_tables"]), slot_mappings=list(kwargs["slot_mappings"]))
        if inp.num_rejected_tokens is not None and not padded:
            inp = drop_rejected_tokens(inp)
        t_pad, b_pad = inp.num_tokens + 3, inp.batch_size + 1
        self.buf.load(inp, t_pad, b_pad)
        first = self.proposer.first_pass(self.buf, t_pad, b_pad)
        if self.tree:
            return self.proposer.tree_drafts(self.buf, b_pad, inp.batch_size, first).token_ids[: inp.batch_size], None
        drafts = self.proposer.chain(self.buf, b_pad, inp.batch_size, first, None, None, False, True)
        return drafts.token_ids[: inp.batch_size], drafts.logits[: inp.batch_size]


def plans(k: int):
    """Prefills over several blocks, decode steps with rejections, and a request whose drafts cross
    max_model_len."""
    q = k + 1
    yield [(0, 5, 0), (1, 37, 0), (2, 1, 0)]
    yield [(0, q, min(1, q - 1)), (1, q, 0), (2, 20, 0)]
    yield [(1, q, q - 1), (0, q, 0), (2, 60, 0)]
    yield [(0, q, q // 2), (2, MAX_MODEL_LEN - 81 - 1, 0), (1, q, 1 % q)]
    yield [(2, 1, 0), (0, q, 0)]  # request 2 now sits at the limit: its drafts run past it
