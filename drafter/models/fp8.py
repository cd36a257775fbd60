"""FP8 block-quantised weights as DeepSeek-V3 ships them, and the GEMM that dequantises them.

A quantised weight W [out, in] is stored as float8_e4m3fn values plus `weight_scale_inv`
[ceil(out / br), ceil(in / bc)] float32, one scale per (br x bc) block (DeepSeek-V3: 128 x 128):
    W[i, j] = float(W_fp8[i, j]) * weight_scale_inv[i // br, j // bc]
Edge blocks may be partial.  The torch path here dequantises the weight into the activations'
dtype and runs one ordinary GEMM (weights FP8 in memory, activations unquantised).  vLLM 0.32 on
Hopper GPUs also quantises the activations per token and 1 x bc group before an FP8 GEMM; that
variant is `block_fp8_linear(..., act_quant=True)` (float32 math).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def expand_scales(
    scale_inv: torch.Tensor,  # [ceil(out / br), ceil(in / bc)] float32
    shape: tuple[int, int],
    block: tuple[int, int],
) -> torch.Tensor:  # [out, in] float32
    """One scale per weight element: each block's scale repeated over its rows and columns."""
    rows, cols = shape
    br, bc = block
    need = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != need:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {need} for {shape} "
                         f"in {br}x{bc} blocks")
    full = scale_inv.float().repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)
    return full[:rows, :cols]


def dequantize(
    weight: torch.Tensor,  # [out, in] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(out / br), ceil(in / bc)] float32
    block: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [out, in] dtype
    if weight.dtype != FP8:
        raise ValueError(f"an fp8 weight must be float8_e4m3fn, got {weight.dtype}")
    return (weight.float() * expand_scales(scale_inv, tuple(weight.shape), block)).to(dtype)


def quantize(
    weight: torch.Tensor,  # [out, in] float
    block: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:  # ([out, in] float8_e4m3fn, [ceil(out/br), ceil(in/bc)] float32)
    """Per-block absmax quantisation (what a released checkpoint's writer did); used by tiny checkpoints."""
    rows, cols = weight.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [nr, nc]
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nr * br, nc * bc)[:rows, :cols].contiguous(), scale_inv


def quantize_activations(
    x: torch.Tensor,  # [num_tokens, in]
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens, in] fp8 values as float32, [num_tokens, groups])
    """Dynamic per-token, per-`group`-columns absmax quantisation of activations to e4m3."""
    n, cols = x.shape
    groups = -(-cols // group)
    padded = torch.zeros(n, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :cols] = x.float()
    view = padded.view(n, groups, group)
    scale = view.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX  # [n, groups]
    q = (view / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
    return q.view(n, groups * group)[:, :cols], scale


def block_fp8_linear(
    x: torch.Tensor,  # [num_tokens, in]
    weight: torch.Tensor,  # [out, in] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(out / br), ceil(in / bc)] float32
    block: tuple[int, int],
    act_quant: bool = False,
) -> torch.Tensor:  # [num_tokens, out], x's dtype
    """x @ W^T with W dequantised; optionally x quantised per (token, bc columns) first, as in w8a8."""
    if not act_quant:
        return F.linear(x, dequantize(weight, scale_inv, block, x.dtype))
    q, x_scale = quantize_activations(x, block[1])
    full_w_scale = expand_scales(scale_inv, tuple(weight.shape), block)  # [out, in]
    x_scale_cols = x_scale.repeat_interleave(block[1], dim=1)[:, : x.shape[1]]  # [n, in]
    # the dequantised operands' product equals the sum over column blocks of the scaled fp8 GEMMs
    return F.linear(q * x_scale_cols, weight.float() * full_w_scale).to(x.dtype)


class FP8Linear(nn.Module):
    """A bias-free linear layer whose weight stays FP8 in memory (checkpoint names `weight`,
    `weight_scale_inv`) and is dequantised into the activations' dtype at each call."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int]):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        nr, nc = -(-out_features // block[0]), -(-in_features // block[1])
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8))
        self.register_buffer("weight_scale_inv", torch.ones(nr, nc, dtype=torch.float32))
        self.kernel = False  # True: the Triton kernel dequantises in registers (set by the head's prepare)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        if self.kernel:
            from drafter.kernels.fp8_gemm import dense_gemm

            return dense_gemm(x, self.weight, self.weight_scale_inv, self.block)
        return block_fp8_linear(x, self.weight, self.weight_scale_inv, self.block)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:  # [out, in]
        return dequantize(self.weight, self.weight_scale_inv, self.block, dtype)

    def _apply(self, fn, recurse=True):
        """Device moves only: a dtype cast would turn the FP8 payload and its float32 scales into
        the activations' dtype (model.to(dtype) must not touch them)."""
        weight, scale = self.weight, self.weight_scale_inv
        moved_w, moved_s = fn(weight), fn(scale)
        self.weight = moved_w if moved_w.dtype == FP8 else weight.to(moved_w.device)
        self.weight_scale_inv = moved_s if moved_s.dtype == torch.float32 else scale.to(moved_s.device)
        return self


def make_linear(in_features: int, out_features: int, block: tuple[int, int] | None) -> nn.Module:
    """An FP8 block-quantised linear when the checkpoint quantises this weight, else nn.Linear."""
    if block is None:
        return nn.Linear(in_features, out_features, bias=False)
    return FP8Linear(in_features, out_features, block)


def linear_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:  # [out, in]
    """The effective (dequantised) weight of either kind of linear layer."""
    if isinstance(module, FP8Linear):
        return module.dequantized(dtype)
    return module.weight.to(dtype)


# --------------------------------------------------------------------------- per-channel FP8 (--weights fp8)
# A weight W [out, in] as float8_e4m3fn values Wq and one float32 scale per output row s [out]:
#     W[i, j] ~= float(Wq[i, j]) * s[i],   s[i] = max_j |W[i, j]| / 448
# Each row's largest entry maps to e4m3's largest finite value; every entry keeps a relative error
# of at most 2^-4 (3 mantissa bits, round to nearest) unless it falls into e4m3's subnormal range,
# below 2^-6 * s[i], where the absolute error is at most 2^-10 * s[i].

HEAD_GEMMS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
              "eh_proj", "head")  # the linears --weights fp8 quantises (MTP: eh_proj ~ fc, shared_head.head ~ lm_head)


def quantize_rows(
    weight: torch.Tensor,  # [out, in] float
) -> tuple[torch.Tensor, torch.Tensor]:  # ([out, in] float8_e4m3fn, [out] float32)
    """Per-output-channel absmax quantisation to e4m3 (an all-zero row gets scale 1)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.contiguous(), scale.contiguous()


def dequantize_rows(
    weight: torch.Tensor,  # [out, in] float8_e4m3fn
    scale: torch.Tensor,  # [out] float32
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [out, in] dtype
    if weight.dtype != FP8:
        raise ValueError(f"a per-channel fp8 weight must be float8_e4m3fn, got {weight.dtype}")
    return (weight.float() * scale.float()[:, None]).to(dtype)


class ChannelFP8Linear(nn.Module):
    """A linear layer whose weight is per-output-channel FP8 in memory (`weight` [out, in] e4m3,
    `weight_scale` [out] float32); the bias, if any, stays in the activations' dtype.  The torch
    path dequantises into x's dtype and runs one GEMM; the fused GPU path (drafter.models.fusion)
    hands weight and scale to drafter.kernels.fp8_channel, which dequantises in the kernel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        self.register_buffer("weight", q.to(linear.weight.device))
        self.register_buffer("weight_scale", scale.to(linear.weight.device))
        self.bias = linear.bias  # the same Parameter (or None)
        self.gemm = None  # the fused path's planned kernel (drafter.kernels.fp8_channel.ChannelFP8Gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        """On the GPU the Triton kernel (planned by fuse_head, else its default tiles); on the CPU
        the dequantise-then-matmul reference."""
        if x.device.type == "cuda":
            from drafter.kernels.fp8_channel import channel_fp8_gemm

            rows = x.reshape(-1, self.in_features)
            y = self.gemm(rows) if self.gemm is not None else channel_fp8_gemm(rows, self.weight, self.weight_scale)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return F.linear(x, dequantize_rows(self.weight, self.weight_scale, x.dtype), self.bias)

    def _apply(self, fn, recurse=True):
        """Device moves only for the payload and its scales (model.to(dtype) must not cast them);
        the bias follows fn as any parameter does."""
        weight, scale = self.weight, self.weight_scale
        moved_w, moved_s = fn(weight), fn(scale)
        self.weight = moved_w if moved_w.dtype == FP8 else weight.to(moved_w.device)
        self.weight_scale = moved_s if moved_s.dtype == torch.float32 else scale.to(moved_s.device)
        if self.bias is not None:
            self.bias.data = fn(self.bias.data)
        return self


class FP8WeightsRefused(ValueError):
    """--weights fp8 asked of a head, input or device it does not support (the message names the flag)."""


def check_fp8_device(device: torch.device) -> None:
    """FP8 e4m3 weights need a GPU of compute capability 8.9 (Ada / Hopper) or newer to convert in
    registers; the CPU runs the dequantise-then-matmul reference."""
    device = torch.device(device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise FP8WeightsRefused(f"--weights fp8 (EngineConfig.weights='fp8') needs a GPU of compute capability "
                                    f">= 8.9 for float8_e4m3fn; {torch.cuda.get_device_name(device)} is "
                                    f"{cap[0]}.{cap[1]}")
    elif device.type != "cpu":
        raise FP8WeightsRefused(f"--weights fp8 (EngineConfig.weights='fp8') runs on cuda or cpu, not {device.type}")


def quantize_head(head: nn.Module) -> nn.Module:
    """Swap the head's GEMM linears (HEAD_GEMMS) for ChannelFP8Linear in place; embeddings, norms
    and buffers stay as they are.  Idempotent.  Refused (naming the flag) for a head that already
    holds FP8 block-quantised weights, or one that is already fused."""
    if any(isinstance(m, FP8Linear) for m in head.modules()):
        raise FP8WeightsRefused("--weights fp8 (EngineConfig.weights='fp8'): this head's checkpoint is already FP8 "
                                "block-quantised (weight_scale_inv); it runs as shipped, drop the flag")
    if getattr(head, "fused", False) and not getattr(head, "fp8_weights", False):
        raise FP8WeightsRefused("--weights fp8 (EngineConfig.weights='fp8'): the head was fused with bf16 weights "
                                "before quantisation; quantise a fresh head")
    if getattr(head, "fp8_weights", False):
        return head
    targets = [(parent, name, child) for parent in head.modules() for name, child in parent.named_children()
               if name in HEAD_GEMMS and type(child) is nn.Linear]
    if not targets:
        raise FP8WeightsRefused(f"--weights fp8 (EngineConfig.weights='fp8'): {type(head).__name__} has none of "
                                f"the linears it quantises ({', '.join(HEAD_GEMMS)})")
    check_fp8_device(targets[0][2].weight.device)
    with torch.no_grad():
        for parent, name, child in targets:
            setattr(parent, name, ChannelFP8Linear(child))
    head.fp8_weights = True
    return head
