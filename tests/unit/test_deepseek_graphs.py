"""The DeepSeek-V3 MTP head in the engine's graph path (the Triton input / step / output kernels around
the MLA + MoE layers): its drafts equal the eager reference engine's.

Without a GPU the runner emulates graphs and the kernels run under the Triton interpreter with every
access bounds-checked; with one, real graphs over drafter.kernels' MLA attention and grouped MoE.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")

from drafter.engine.graphs import GraphRunner  # noqa: E402
from tests.support.engines import build_engine  # noqa: E402
from tests.support.scenario import Scenario  # noqa: E402
from tests.support.triton_bounds import allowing, allowing_outputs  # noqa: E402
from tests.support.triton_bounds import bounds_checked  # noqa: E402,F401 - an autouse fixture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_MODEL_LEN = 48
K = 3


def _engine(root, **config):
    kw = dict(k=K, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=32,
              capture_sizes=(2, 4), token_capture_sizes=(8, 16, 32))
    kw.update(config)
    engine = build_engine(root, "deepseek_mtp", **kw)
    if DEVICE == "cpu" and engine.backend.name == "triton":
        engine.graphs = GraphRunner(engine, emulate=True)
    return engine


def test_graph_path_drafts_what_the_eager_engine_drafts(tiny_root):
    ref = _engine(tiny_root, attention_backend="reference")
    fast = _engine(tiny_root, attention_backend="triton", device=DEVICE)
    assert fast.graphs is not None
    s_ref, s_fast = (Scenario(block_sizes=e.limits.block_sizes, num_blocks=e.limits.num_blocks, vocab_size=512,
                              hidden_width=64, k=K, max_model_len=MAX_MODEL_LEN, seed=4,
                              draft_span=e.limits.draft_span) for e in (ref, fast))
    q = K + 1
    for plan in ([(0, 9, 0), (1, 12, 0)], [(0, q, 1), (1, q, 0), (2, q, 2)], [(0, q, 0), (2, q, 1)]):
        expected = ref.propose(**s_ref.call(plan).kwargs).draft_token_ids
        kwargs = {k: ([t.to(DEVICE) for t in v] if isinstance(v, list) else v.to(DEVICE))
                  for k, v in s_fast.call(plan).kwargs.items()}
        tensors = [t for v in kwargs.values() for t in (v if isinstance(v, list) else [v])]
        with allowing(tensors), allowing_outputs(fast.graphs):
            got = fast.propose(**kwargs).draft_token_ids
        assert torch.equal(got.cpu(), expected), f"plan {plan}"
    assert fast.graph_replays == 3
