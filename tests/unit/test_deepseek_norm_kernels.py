"""DeepSeek MTP's RMSNorms as one Triton launch each (DeepseekMTPHead.fuse_norms, on whenever the head runs
its GPU kernels): the layer's output equals the torch norms' to float32 rounding, the MLA kv latent's
strided norm input included.  Without a GPU the kernel runs under the Triton interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed: the norm kernel cannot run")

from drafter.attention.metadata import AttentionMetadata  # noqa: E402
from drafter.models.deepseek_loader import load_deepseek_mtp  # noqa: E402
from drafter.models.layers import RMSNorm  # noqa: E402
from drafter.models.tiny_deepseek import write_tiny_deepseek  # noqa: E402


def test_fused_norms_keep_the_layer_output(tmp_path):
    write_tiny_deepseek(tmp_path, seed=2)
    plain = load_deepseek_mtp(tmp_path / "head", dtype=torch.float32, kernels=False)
    fused = load_deepseek_mtp(tmp_path / "head", dtype=torch.float32, kernels=False)
    fused.fuse_norms()
    norms = [m for m in fused.modules() if isinstance(m, RMSNorm)]
    assert norms and all("forward" in vars(m) for m in norms)  # every norm switched (7 per layer)
    h = plain.config.hidden_size
    g = torch.Generator().manual_seed(0)
    n, block = 5, 16
    ids = torch.randint(0, plain.config.vocab_size, (n,), generator=g)
    positions = torch.arange(3, 3 + n)
    hidden = torch.randn(n, h, generator=g)
    outs = []
    for head in (plain, fused):
        cache = torch.zeros(plain.config.layers[0].kv_cache_shape(4, block))
        meta = AttentionMetadata(query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                                 seq_lens=torch.tensor([3 + n], dtype=torch.int32),
                                 block_table=torch.tensor([[0, 1]], dtype=torch.int32),
                                 slot_mapping=positions.clone(), block_size=block)
        with torch.no_grad():
            outs.append(head(ids, positions, hidden, [cache], [meta]))
    for want, got in zip(*outs):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
