"""--shape PRESET: random-weight draft heads of real shapes, so payloads and GPU work are real-sized.

A load test needs a drafter that does the work of a real head (a Llama-3.1-8B EAGLE-3 head reads
~750 MB of weights per step and takes 3 x 4096 bf16 hidden values per token), not its accuracy:
random weights in the real layout do.  No hub exists, so the checkpoint is written locally, with
the same writers as `drafter make-tiny` (vLLM speculators EAGLE-3 layout), into a directory that
is reused when it already holds the preset:

    head/    config.json + model.safetensors (fc, layers.0, norm, lm_head over the draft vocab, d2t)
    target/  config.json of the target + model.safetensors holding only model.embed_tokens.weight
             (bfloat16): all that an EAGLE-3 head borrows from its target.  A full 8B target
             would cost 16 GB of disk for layers the drafter never loads.

Writing the 8B preset takes ~1-2 min on one CPU core (tens of seconds on a GPU host) and ~2.7 GB
of disk; the drafter loads it like any checkpoint (`drafter serve --model DIR/head
--target-model DIR/target`).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from drafter.models.tiny import TinySizes, _llama_config, write_eagle3

PRESETS: dict[str, tuple[str, TinySizes, str]] = {
    # name -> (method, sizes, what it is)
    "llama3-8b-eagle3": ("eagle3", TinySizes(
        hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
        vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, aux_layer_ids=(2, 16, 29),
        draft_vocab_size=32000), "EAGLE-3 head for Llama-3.1-8B (hidden 4096, 3 aux layers, draft vocab 32k)"),
    "llama3-70b-eagle3": ("eagle3", TinySizes(
        hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=28672,
        vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, aux_layer_ids=(2, 40, 77),
        draft_vocab_size=32000), "EAGLE-3 head for Llama-3.3-70B (hidden 8192, 3 aux layers, draft vocab 32k)"),
    # the same code path at a size a CPU serves: for dry runs of the GPU script
    "mini-eagle3": ("eagle3", TinySizes(
        hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512,
        vocab_size=8192, aux_layer_ids=(1, 4, 6), draft_vocab_size=2048), "a small EAGLE-3 head for CPU dry runs"),
}


def write_shaped(preset: str, out_dir: str | Path, seed: int = 0) -> tuple[str, Path, Path]:
    """Write (or reuse) the preset's head + embedding-only target; return (method, head dir, target dir)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown shape {preset!r}; choose from {sorted(PRESETS)}")
    method, sizes, _ = PRESETS[preset]
    out = Path(out_dir)
    head, target = out / "head", out / "target"
    stamp = out / "preset.json"
    want = json.loads(json.dumps({"preset": preset, "seed": seed, "sizes": asdict(sizes)}))  # as stored
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return method, head, target
    write_eagle3(head, sizes, seed + 1)
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps({**_llama_config(sizes, sizes.num_layers),
                                                     "torch_dtype": "bfloat16"}, indent=2) + "\n")
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(sizes.vocab_size, sizes.hidden_size, generator=g, dtype=torch.bfloat16)  # [vocab, hidden]
    save_file({"model.embed_tokens.weight": embed}, str(target / "model.safetensors"))
    stamp.write_text(json.dumps(want, indent=1) + "\n")
    return method, head, target
