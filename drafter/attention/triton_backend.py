"""Paged attention in Triton: the reference backend's behaviour, fast and graph-capturable.

Same contract as ReferenceBackend.forward (write k/v at the slot mapping, then attend), plus
`forward_rope`, which also applies the rotary embedding to the fused q/k/v projection and
writes the cache in the same launch.  Launch parameters (grid, block shapes, number of key
splits) come from tensor shapes only, so a captured CUDA graph stays valid for any values
the static buffers later hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from drafter.kernels.kv_write import rope_write_kernel, write_kv_kernel
from drafter.kernels.paged_attention import combine_splits_kernel, paged_attention_kernel
from drafter.kernels.step_inputs import decode_step_inputs
from drafter.attention.metadata import AttentionMetadata
from drafter.models.rope import RopeTables

MAX_SPLITS = 64
BLOCK_N = 64  # keys per tile: four 16-token pages, 16 KB of bf16 keys at head_dim 128


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def _check_cache(kv_cache: torch.Tensor, head_dim: int) -> None:
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache: the head dimension must be contiguous")
    if head_dim & (head_dim - 1):
        raise ValueError(f"TritonBackend needs a power-of-two head_dim, got {head_dim}")


PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class AttentionLaunch:
    """Tile and pipeline shape of the paged attention kernel, and how many programs (key splits
    included) per SM a launch of it aims for."""
    block_n: int = BLOCK_N  # keys per tile
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = PROGRAMS_PER_SM


# Measured on an H100 (bench/probe_attention.py, 2026-11-24; decode attention alone, graph-timed;
# bench/results/2026-11-24-h100-attention-launch/): a launch of few (request, KV head) programs
# is latency-bound and fastest with long tiles and a deep pipeline (batch 1, 1k context: 8.3 us vs
# 9.5 with 64-key tiles); a mid-size grid (batch 8-32: 64-256 programs before splitting) streams
# fastest as 8-warp programs over 128-key tiles, two per SM (batch 16 at 1k: 32.5 us vs 36.9 with
# 4-warp 64-key tiles at four per SM; batch 32: 52.3 vs 55.2; at 8k 1-3 us less); a full grid
# (batch 64: 512 programs) with 4-warp 64-key tiles (96.6 us, 0.94 of copy bandwidth, vs 98.2).
SMALL_GRID_LAUNCH = AttentionLaunch(block_n=128, num_warps=4, num_stages=4)
MID_GRID_LAUNCH = AttentionLaunch(block_n=128, num_warps=8, num_stages=3, programs_per_sm=2)


class TritonBackend:
    name = "triton"

    # the proposer's chain asks for the next step's positions, seq_lens and slots through this
    decode_step_inputs = staticmethod(decode_step_inputs)

    def __init__(self, num_splits: int | None = None, target_programs: int | None = None,
                 launch: AttentionLaunch | None = None):
        """num_splits: force the number of key splits (tests); None = pick from the grid size.
        target_programs: force how many programs (splits included) a launch aims for; None = the
        launch's programs_per_sm x the device's SMs.
        launch: force the attention kernel's tile shape; None = pick from the grid size."""
        self.num_splits = num_splits
        self._target_programs = target_programs
        self.launch = launch

    def target_programs(self, device: torch.device, launch: AttentionLaunch = AttentionLaunch()) -> int:
        if self._target_programs is not None:
            return self._target_programs
        if device.type != "cuda":
            return 16  # the interpreter: keep the split path exercised
        return launch.programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count

    # ------------------------------------------------------------------ public API
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotary applied
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        self.write_kv(k, v, kv_cache, meta.slot_mapping, meta.block_size)
        return self.attend(q, kv_cache, meta, sliding_window)

    def forward_rope(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], before rotary
        positions: torch.Tensor,  # [num_tokens] int
        rope: RopeTables | torch.Tensor,  # drafter.models.rope tables; a bare [head_dim // 2] f32 inv_freq = plain rope
        num_heads: int,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        n = qkv.shape[0]
        num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
        _check_cache(kv_cache, head_dim)
        if qkv.stride(-1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(f"qkv: expected contiguous rows of {(num_heads + 2 * num_kv_heads) * head_dim}")
        q = torch.empty(n, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        # the kernel indexes row t at ptr + t: a broadcast view (stride 0, as the tree's
        # per-node positions can be) must become real rows first
        positions, slots = positions.contiguous(), meta.slot_mapping.contiguous()
        if not isinstance(rope, RopeTables):
            rope = RopeTables(rope, 1.0, 1.0, head_dim)
        if n:
            q_heads = min(8, _pow2(num_heads))  # several programs per token: a one-row step is latency-bound
            rope_write_kernel[(n, triton.cdiv(num_heads, q_heads) + 1)](
                qkv, qkv.stride(0), positions, rope.inv_freq, rope.position_divisor, rope.magnitude, q,
                kv_cache, kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(0),
                slots, num_heads, num_kv_heads,
                BLOCK_SIZE=meta.block_size, Q_HEADS=q_heads, KV_HEADS_PAD=_pow2(num_kv_heads),
                HEAD_DIM=head_dim, ROT_HALF=rope.rotary_dim // 2)
        return self.attend(q, kv_cache, meta, sliding_window)

    def write_kv(self, k, v, kv_cache, slot_mapping, block_size: int) -> None:
        n, num_kv_heads, head_dim = k.shape
        _check_cache(kv_cache, head_dim)
        if n == 0:
            return
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            k, v = k.contiguous(), v.contiguous()
        write_kv_kernel[(n,)](
            k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
            kv_cache, kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(0),
            slot_mapping.contiguous(), num_kv_heads,
            BLOCK_SIZE=block_size, HEADS_PAD=_pow2(num_kv_heads), HEAD_DIM=head_dim)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               sliding_window: int | None) -> torch.Tensor:
        """Attention of q over the cache (already holding this step's keys)."""
        n, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[-2]
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        if n == 0:
            return out
        num_reqs = meta.query_start_loc.shape[0] - 1
        group = num_heads // num_kv_heads
        group_pad = _pow2(group)
        decode_shaped = n <= num_reqs  # draft steps: one query row per request
        block_m = max(16, group_pad if decode_shaped else 8 * group_pad)
        block_q = max(1, block_m // group_pad)
        num_qblocks = n // block_q + num_reqs + 1  # enough for every request's blocks + the padding rows
        # a q-block never spans two requests: at least one per request, and one per block_q tokens
        programs = max(num_reqs, -(-n // block_q)) * num_kv_heads
        launch = self._launch(q.device, programs)
        splits = self._splits(q.device, programs, meta.block_table.shape[1] * meta.block_size, launch)
        tree = meta.tree_mask is not None
        qsl, seq_lens = meta.query_start_loc.contiguous(), meta.seq_lens.contiguous()
        if meta.block_table.stride(1) != 1:
            raise ValueError("block_table rows must be contiguous")
        mask = meta.tree_mask.contiguous() if tree else seq_lens  # any tensor: unused without a tree
        depths = meta.tree_depths.contiguous() if tree else seq_lens
        num_nodes = meta.tree_mask.shape[1] if tree else 0
        window = sliding_window or 0
        if splits > 1:
            part = torch.empty(splits, n, num_heads, head_dim, dtype=torch.float32, device=q.device)
            ml = torch.empty(splits, n, num_heads, 2, dtype=torch.float32, device=q.device)
        else:
            part = ml = out
        paged_attention_kernel[(num_qblocks, num_kv_heads, splits)](
            q, q.stride(0), q.stride(1),
            kv_cache, kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(0),
            qsl, seq_lens, meta.block_table, meta.block_table.stride(0),
            mask, depths, num_nodes,
            out, out.stride(0), out.stride(1), part, ml,
            n, num_reqs, num_heads, head_dim ** -0.5, window,
            BLOCK_SIZE=meta.block_size, GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
            BLOCK_N=launch.block_n, HEAD_DIM=head_dim, NUM_SPLITS=splits, IS_TREE=tree, HAS_WINDOW=window > 0,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=launch.num_warps, num_stages=launch.num_stages)
        if splits > 1:
            # the interpreter runs programs one by one: give it few, each over all heads
            heads = _pow2(num_heads) if q.device.type == "cpu" else 1
            combine_splits_kernel[(n, triton.cdiv(num_heads, heads))](
                part, ml, out, out.stride(0), out.stride(1), n, num_heads,
                NUM_SPLITS=splits, HEAD_DIM=head_dim, HEADS=heads, num_warps=4)
        return out

    def _launch(self, device, programs: int) -> AttentionLaunch:
        """The tile shape for a launch of `programs` (request block, KV head) programs before splitting."""
        if self.launch is not None:
            return self.launch
        if device.type != "cuda":
            return AttentionLaunch()
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if programs * 4 <= sms:
            return SMALL_GRID_LAUNCH
        if programs <= 2 * sms:
            return MID_GRID_LAUNCH
        return AttentionLaunch()

    def _splits(self, device, programs: int, max_keys: int, launch: AttentionLaunch = AttentionLaunch()) -> int:
        """The most key splits (a power of two) that keep the launch within target_programs programs."""
        max_tiles = -(-max_keys // launch.block_n)
        if self.num_splits is not None:
            return max(1, min(self.num_splits, _pow2(max_tiles)))
        fit = max(1, self.target_programs(device, launch) // max(1, programs))
        return max(1, min(1 << (fit.bit_length() - 1), MAX_SPLITS, _pow2(max_tiles)))
