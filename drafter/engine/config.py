"""The engine's one configuration object, validated once at the edge and passed down as plain values."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

METHODS = ("eagle", "eagle3", "mtp", "deepseek_mtp", "extract_hidden_states")
MTP_METHODS = ("mtp", "deepseek_mtp")
# Which MTP layer draft step s runs (docs/vllm-0.32-proposer.md, section 14):
#   first_layer  layer 0 at every step (vLLM 0.32's V1 EagleProposer, and MRv2's MTPSpeculator)
#   per_step     layer s mod n, each layer's KV written only by its steps (vLLM's Step3.5 proposer)
MTP_LAYER_SCHEDULES = ("first_layer", "per_step")


@dataclass(frozen=True)
class KVGroupSpec:
    """One KV cache group: layers sharing a block size, block table and slot mapping."""

    block_size: int
    num_blocks: int

    def __post_init__(self):
        if self.block_size <= 0:
            raise ValueError(f"kv_groups.block_size must be positive, got {self.block_size}")
        if self.num_blocks <= 0:
            raise ValueError(f"kv_groups.num_blocks must be positive, got {self.num_blocks}")


def parse_token_tree(tree) -> tuple[tuple[int, ...], ...]:
    """Validate a speculative token tree: a list of paths (tuples of child ranks).

    Every path's parent must precede it, and within a level the children of a
    parent must be ranks 0..n-1, so that top-k per parent can fill the level.
    """
    paths = tuple(tuple(int(i) for i in p) for p in tree)
    seen: set[tuple[int, ...]] = {()}
    for p in paths:
        if not p or any(i < 0 for i in p):
            raise ValueError(f"speculative_token_tree: bad path {p}")
        if p[:-1] not in seen:
            raise ValueError(f"speculative_token_tree: parent of {p} must come before it")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
            raise ValueError(f"speculative_token_tree: sibling ranks of {p} must be contiguous from 0")
        if p in seen:
            raise ValueError(f"speculative_token_tree: duplicate path {p}")
        seen.add(p)
    depths = [len(p) for p in paths]
    if depths != sorted(depths):
        raise ValueError("speculative_token_tree: paths must be ordered by depth (breadth first)")
    return paths


@dataclass(frozen=True)
class EngineConfig:
    method: str
    num_speculative_tokens: int = 3
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_groups: tuple[KVGroupSpec, ...] = (KVGroupSpec(16, 256),)
    speculative_token_tree: tuple[tuple[int, ...], ...] | None = None
    # Batch sizes (draft loop) and token counts (first pass) that buffers are padded to;
    # on a GPU each gets its own CUDA graph.  Empty = derive powers of two up to the max.
    capture_sizes: tuple[int, ...] = ()
    token_capture_sizes: tuple[int, ...] = ()
    # True: rejected tokens stay in the batch and shapes stay fixed (vLLM's default).
    # False: rejected tokens are dropped before the first pass (vLLM's prepare_inputs).
    padded_drafter_batch: bool = True
    device: str = "cpu"
    dtype: str = "float32"
    use_cuda_graphs: bool = True
    # With graphs: also capture the first pass and the draft loop as ONE graph for each
    # (tokens, batch) pair a decode step pads to, so a steady-state call costs one replay (a few
    # microseconds of host time less).  The price: about twice the graphs, so about twice the
    # capture time at start-up, and each graph's own device memory for its kernel nodes; the
    # activations share the one graph pool (graphs never run at once), so the pool barely grows.
    # False keeps the two-graph path only (e.g. many capture sizes and a tight start-up budget).
    combined_graphs: bool = True
    attention_backend: str = "auto"  # auto | reference | triton
    # The Triton path's weight GEMMs for <= 64 rows: "auto" times drafter's skinny kernel
    # against cuBLAS per weight at start-up and keeps the faster; "on" / "off" force it.
    skinny_gemm: str = "auto"
    # The head's GEMM weights (fc, q/k/v, o, gate/up, down, lm_head): "bf16" keeps them as loaded
    # (the checkpoint's values in `dtype`); "fp8" quantises them at load to per-output-channel
    # float8_e4m3fn with a float32 scale per row (drafter.models.fp8.quantize_head), dequantised in
    # the GEMM kernels: half the weight bytes per step, drafts no longer vLLM's.  Embeddings stay.
    weights: str = "bf16"
    # Pre-drafting (drafter.engine.predraft): after each draft, the next step's drafts for this many
    # likeliest verification outcomes per request (0 = off), each predraft_tokens long (0 = k).
    predraft_outcomes: int = 0
    predraft_tokens: int = 0
    # MTP methods only (MTP_LAYER_SCHEDULES); "" = the method's own: deepseek_mtp drafts as vLLM
    # 0.32's V1 runner does (first_layer), this engine's mtp layout steps through its layers (per_step)
    mtp_layer_schedule: str = ""
    seed: int = 0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.kv_groups:
            raise ValueError("kv_groups must name at least one group")
        object.__setattr__(self, "kv_groups", tuple(self.kv_groups))
        if self.speculative_token_tree is not None:
            tree = parse_token_tree(self.speculative_token_tree)
            object.__setattr__(self, "speculative_token_tree", tree)
            object.__setattr__(self, "num_speculative_tokens", max(len(p) for p in tree))
        if self.method == "extract_hidden_states" and self.num_speculative_tokens != 1:
            raise ValueError("extract_hidden_states proposes exactly one token: num_speculative_tokens must be 1")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "reference", "triton"):
            raise ValueError(f"attention_backend must be auto, reference or triton, got {self.attention_backend!r}")
        if not isinstance(self.combined_graphs, bool):
            raise ValueError(f"combined_graphs must be a bool, got {self.combined_graphs!r}")
        if self.skinny_gemm not in ("auto", "on", "off"):
            raise ValueError(f"skinny_gemm must be auto, on or off, got {self.skinny_gemm!r}")
        if self.weights not in ("bf16", "fp8"):
            raise ValueError(f"weights must be bf16 or fp8, got {self.weights!r}")
        if self.weights == "fp8" and self.method in ("deepseek_mtp", "extract_hidden_states"):
            why = ("its checkpoint is FP8 block-quantised already and runs as shipped"
                   if self.method == "deepseek_mtp" else "it has no draft head")
            raise ValueError(f"weights='fp8' (--weights fp8) is not supported for method {self.method}: {why}")
        _check_predraft(self)
        object.__setattr__(self, "mtp_layer_schedule", _mtp_layer_schedule(self.method, self.mtp_layer_schedule))
        object.__setattr__(self, "capture_sizes", _sizes(self.capture_sizes, self.max_num_seqs, "capture_sizes"))
        object.__setattr__(
            self,
            "token_capture_sizes",
            _sizes(self.token_capture_sizes, self.max_num_batched_tokens, "token_capture_sizes"),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def num_tree_nodes(self) -> int:
        return len(self.speculative_token_tree) if self.speculative_token_tree else 0

    @property
    def predraft_k(self) -> int:
        """Drafts per pre-draft (predraft_tokens, or k when 0)."""
        return self.predraft_tokens or self.num_speculative_tokens

    @property
    def max_blocks_per_req(self) -> tuple[int, ...]:
        """Block-table width per group: enough blocks for max_model_len (+ tree nodes)."""
        span = self.max_model_len + self.num_tree_nodes
        return tuple(-(-span // g.block_size) for g in self.kv_groups)


def _check_predraft(cfg: EngineConfig) -> None:
    if cfg.predraft_outcomes < 0 or cfg.predraft_tokens < 0:
        raise ValueError("predraft_outcomes and predraft_tokens must be >= 0")
    if cfg.predraft_outcomes and cfg.method not in ("eagle", "eagle3"):
        raise ValueError(f"predraft_outcomes: pre-drafting supports eagle and eagle3, not {cfg.method}")
    if cfg.predraft_outcomes and cfg.speculative_token_tree is not None:
        raise ValueError("predraft_outcomes: pre-drafts are chains; a speculative_token_tree is not supported")
    deeper = cfg.predraft_tokens > cfg.num_speculative_tokens  # a hit's next call: k' + 1 tokens a row
    if deeper and cfg.max_num_seqs * (cfg.predraft_tokens + 1) > cfg.max_num_batched_tokens:
        raise ValueError(f"predraft_tokens {cfg.predraft_tokens}: a call after hits carries max_num_seqs x "
                         f"(k' + 1) = {cfg.max_num_seqs * (cfg.predraft_tokens + 1)} tokens, above "
                         f"max_num_batched_tokens {cfg.max_num_batched_tokens}")
    if cfg.predraft_tokens >= cfg.max_model_len:
        raise ValueError(f"predraft_tokens {cfg.predraft_tokens}: must be below max_model_len {cfg.max_model_len}")


def _mtp_layer_schedule(method: str, schedule: str) -> str:
    """The schedule an MTP method drafts with ("" for other methods); refusals name the key."""
    if method not in MTP_METHODS:
        if schedule:
            raise ValueError(f"mtp_layer_schedule={schedule!r} applies to methods {MTP_METHODS}, not {method}")
        return ""
    if not schedule:
        return "first_layer" if method == "deepseek_mtp" else "per_step"
    if schedule == "multi_module":
        raise ValueError("mtp_layer_schedule='multi_module' (vLLM 0.32 Model Runner V2's MultiModuleMTPSpeculator) "
                         "is not implemented: it re-runs MTP module s over each request's whole query window at "
                         "unchanged positions, with rows cached across calls; this engine drafts chains "
                         f"(choose one of {MTP_LAYER_SCHEDULES})")
    if schedule not in MTP_LAYER_SCHEDULES:
        raise ValueError(f"mtp_layer_schedule must be one of {MTP_LAYER_SCHEDULES}, got {schedule!r}")
    return schedule


def check_mtp_layers(config: EngineConfig, num_mtp_layers: int) -> None:
    """What only the head's layer count decides: refuse a deepseek_mtp set-up vLLM 0.32 never drafts."""
    if config.method != "deepseek_mtp" or num_mtp_layers <= 1:
        return
    k = config.num_speculative_tokens
    if k > num_mtp_layers and k % num_mtp_layers:
        raise ValueError(f"num_speculative_tokens={k} with {num_mtp_layers} MTP layers (num_nextn_predict_layers): "
                         "vLLM 0.32 refuses k above the layer count unless divisible by it")
    if config.mtp_layer_schedule == "per_step" and k > 1:
        raise ValueError(f"mtp_layer_schedule='per_step' with deepseek_mtp ({num_mtp_layers} MTP layers, k={k}): no "
                         "vLLM 0.32 runner drafts a DeepSeek checkpoint that way (V1 runs layer 0 at every step: "
                         "'first_layer'; Model Runner V2 runs its multi-module speculator, not implemented here)")


def _sizes(sizes, maximum: int, name: str) -> tuple[int, ...]:
    if not sizes:
        out, s = [], 1
        while s < maximum:
            out.append(s)
            s *= 2
        out.append(maximum)
        return tuple(out)
    out = tuple(sorted(set(int(s) for s in sizes)))
    if out[0] <= 0:
        raise ValueError(f"{name} must be positive")
    if out[-1] < maximum:
        out = out + (maximum,)  # the largest size always covers the limit
    return out


def pad_to_capture_size(n: int, sizes: tuple[int, ...]) -> int:
    """Smallest capture size >= n (sizes are sorted and end at the configured maximum).
    A binary search in C: this runs twice per propose call."""
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{n} exceeds the largest capture size {sizes[-1]}")
    return sizes[i]
