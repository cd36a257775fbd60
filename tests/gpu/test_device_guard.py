"""On a host of two GPUs: an engine on cuda:1 drafts the same whichever GPU is current.

Triton launches and torch's default streams follow the current device, not the tensors', so
without DraftEngine.on_device an engine on cuda:1 called from a thread whose current device is
cuda:0 (a target process that put its own model on cuda:0) launched its kernels on the wrong GPU.
Elsewhere every test here is skipped with a message (CI has no GPU).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices: run on a 2-GPU host"),
]

MAX_MODEL_LEN = 96
PLANS = [[(0, 9, 0), (1, 30, 0)], [(0, 4, 1), (1, 4, 0), (2, 3, 0)], [(0, 4, 2), (2, 4, 3), (3, 17, 0)]]


def _drafts(tiny_root, current: int, graphs: bool) -> list[list[list[int]]]:
    """Every plan's drafts of a fresh eagle3 engine on cuda:1 built and called with cuda:`current` current."""
    from tests.support.engines import build_engine
    from tests.support.scenario import Scenario

    torch.cuda.set_device(current)
    try:
        engine = build_engine(tiny_root, "eagle3", k=3, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                              max_num_batched_tokens=128, device="cuda:1", attention_backend="triton",
                              use_cuda_graphs=graphs)
        scenario = Scenario(block_sizes=engine.limits.block_sizes, num_blocks=engine.limits.num_blocks,
                            vocab_size=engine.spec.vocab_size, hidden_width=engine.spec.hidden_input_width,
                            k=engine.config.num_speculative_tokens, max_model_len=MAX_MODEL_LEN, seed=3,
                            draft_span=engine.limits.draft_span)
        out = []
        for plan in PLANS:
            kwargs = scenario.call(plan).kwargs
            kwargs = {k: ([t.to("cuda:1") for t in v] if isinstance(v, list) else v.to("cuda:1"))
                      for k, v in kwargs.items()}
            out.append(engine.propose(**kwargs).draft_token_ids.tolist())
        torch.cuda.synchronize("cuda:1")
        assert torch.cuda.current_device() == current  # the guard restores the caller's device
        return out
    finally:
        torch.cuda.set_device(0)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_engine_on_the_second_gpu_ignores_the_current_device(tiny_root, graphs):
    assert _drafts(tiny_root, 0, graphs) == _drafts(tiny_root, 1, graphs)
