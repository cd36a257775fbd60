"""Build tiny engines (and their scenarios) the way tests need them."""

from __future__ import annotations

from pathlib import Path

from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.engine.engine import DraftEngine
from drafter.models.spec import parse_head, read_config
from drafter.models.tiny import TinySizes, VARIANTS, write_tiny

# test name -> (tiny variant, sizes override)
HEADS = {
    "eagle": ("eagle", None),
    "eagle3": ("eagle3", None),
    "mtp": ("mtp", None),
    "mtp-multi": ("mtp-multi", None),
    "deepseek_mtp": ("deepseek_mtp", None),
    # a two-layer EAGLE-1 head: a full-attention group and a sliding-window group
    "eagle-2groups": ("eagle", TinySizes(head_layer_types=("full_attention", "sliding_attention"))),
}
BLOCK_SIZES = (16, 8)  # group 0, group 1: deliberately different


def tiny_dirs(root: Path, name: str, seed: int = 0) -> tuple[str, Path]:
    variant, sizes = HEADS.get(name, (name, None))
    out = root / name
    if not (out / "head" / "config.json").exists():
        write_tiny(variant, out, seed=seed, sizes=sizes)
    return VARIANTS[variant][0], out


def build_engine(root: Path, name: str, *, k: int = 3, max_model_len: int = 96, num_blocks: int = 64,
                 **config) -> DraftEngine:
    method, out = tiny_dirs(root, name)
    groups = max(1, parse_head(read_config(out / "head"), method).num_kv_groups)
    # tiny weights: the skinny kernels always (timing cuBLAS against them per weight costs a GPU
    # test run minutes of compiles and says nothing about tiny shapes)
    config.setdefault("skinny_gemm", "on")
    cfg = EngineConfig(
        method=method, num_speculative_tokens=1 if method == "extract_hidden_states" else k,
        max_model_len=max_model_len, max_num_seqs=config.pop("max_num_seqs", 8),
        max_num_batched_tokens=config.pop("max_num_batched_tokens", 256),
        kv_groups=tuple(KVGroupSpec(BLOCK_SIZES[g], num_blocks) for g in range(groups)), **config)
    return DraftEngine.from_dirs(out / "head", out / "target", cfg)
