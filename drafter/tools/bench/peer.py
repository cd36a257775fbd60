"""`drafter bench`'s peer: the engine's greedy draft step written in plain PyTorch and compiled
with torch.compile, as a user without this engine would run it (vLLM runs its own drafter so).

    peer = CompiledPeer(head, spec, engine)     # weights from the head, the engine's KV copied
    drafts = peer.propose(call)                  # [batch, k] int64 for a bench call (decode_call)
    graph = peer.capture(call); graph.replay()   # the whole step as one CUDA graph

What it computes, for an EAGLE-3 or EAGLE-1 head of one layer (the bench's heads), is the
engine's chain (drafter.engine.proposer) for a padded-drafter-batch call: the first pass over every
query row of every request (token t+1 beside hidden state t, next_token_ids at the sampled
rows), greedy argmax (+ d2t) at the sampled rows, then k - 1 decode steps with positions,
slots and sequence lengths derived from the block table as the engine's loop does (steps past
max_model_len write nothing and see one key; rows of seq_len 0 read nothing).  Requests may
have any lengths and any blocks: the KV is paged.

How it is built:
  * the dense work (fc, RMS norms, merged q/k/v and gate/up GEMMs as vLLM merges them, rotary,
    SiLU, lm_head, argmax, the step inputs) is plain torch, compiled with torch.compile
    (fullgraph, static shapes, inductor's default mode: cuBLAS GEMMs, fused Triton kernels for
    the rest), once per (tokens, batch) shape;
  * paged attention (KV write + attention over the block table) is the engine's own Triton
    kernel, called as an opaque custom op, as vLLM calls its attention backend from compiled
    code: the ratio engine / peer measures everything but attention;
  * the whole step (first pass + k - 1 steps) is captured as one CUDA graph per shape, on a
    stream and pool of its own, reading the call's tensors in place: replaying it costs the peer
    no host work, which the engine's public call does pay (its header write).
It writes its own copy of the engine's KV cache, so the two never disturb each other.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from drafter.attention.metadata import PADDING_SLOT_ID, AttentionMetadata


# ---------------------------------------------------------------------- attention as a custom op
def _attention_backend(device: torch.device):
    """The engine's Triton paged attention on a GPU; the reference backend elsewhere (tests)."""
    if device.type == "cuda":
        from drafter.attention.triton_backend import TritonBackend

        return TritonBackend()
    from drafter.attention.reference import ReferenceBackend

    return ReferenceBackend()


_BACKENDS: dict[str, object] = {}
# KV caches by id: the op finds its cache here, as vLLM's attention op finds the layer's cache,
# so that the compiler sees no mutated input (and copies no cache); the KV write is ordered by
# data dependence (each forward's q / k / v come from the previous forward's output)
_CACHES: dict[int, torch.Tensor] = {}
_CACHE_IDS = itertools.count()


@torch.library.custom_op("drafter_peer::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotary applied
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [batch + 1] int32
    seq_lens: torch.Tensor,  # [batch] int32
    block_table: torch.Tensor,  # [batch, max_blocks] int32
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = write nothing
    cache_id: int,
    block_size: int,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write k / v at the slots of cache _CACHES[cache_id] ([2, num_blocks, block_size,
    num_kv_heads, head_dim]), then attend over each request's pages (the engine's kernels)."""
    backend = _BACKENDS.setdefault(q.device.type, _attention_backend(q.device))
    meta = AttentionMetadata(query_start_loc, seq_lens, block_table, slot_mapping, block_size)
    return backend.forward(q, k, v, _CACHES[cache_id], meta)


@paged_attention.register_fake
def _paged_attention_fake(q, k, v, query_start_loc, seq_lens, block_table, slot_mapping, cache_id, block_size):
    return torch.empty_like(q)


# ---------------------------------------------------------------------- the step in plain torch
@dataclass(frozen=True)
class PeerWeights:
    """One head layer's weights as plain tensors (merged q/k/v and gate/up) and its constants."""
    method: str  # "eagle3" | "eagle"
    embed: torch.Tensor  # [target_vocab, H]
    fc: torch.Tensor  # [H, fc_in]
    fc_bias: torch.Tensor | None  # [H]
    input_norm: torch.Tensor | None  # [H] (EAGLE-3: the embeddings' norm)
    hidden_norm: torch.Tensor | None  # [H] (EAGLE-3)
    qkv: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, attn_in]
    o: torch.Tensor  # [H, heads * head_dim]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]
    final_norm: torch.Tensor | None  # [H] (EAGLE-3)
    lm_head: torch.Tensor  # [draft_vocab, H]
    d2t: torch.Tensor | None  # [draft_vocab] int64 (EAGLE-3)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    norm_before_residual: bool


def peer_weights(head, spec) -> PeerWeights:
    """The head's weights for the peer (q/k/v and gate/up concatenated once, here)."""
    if spec.method not in ("eagle3", "eagle") or spec.num_layers != 1:
        raise ValueError(f"the compiled peer covers one-layer EAGLE-3 / EAGLE-1 heads, not {spec.method} "
                         f"with {spec.num_layers} layers")
    layer = head.layers[0]
    attn, mlp, shape = layer.self_attn, layer.mlp, spec.layer_shapes[0]
    eagle3 = spec.method == "eagle3"
    with torch.no_grad():
        return PeerWeights(
            method=spec.method, embed=head.embed_tokens.weight, fc=head.fc.weight, fc_bias=head.fc.bias,
            input_norm=layer.input_layernorm.weight if eagle3 else None,
            hidden_norm=layer.hidden_norm.weight if eagle3 else None,
            qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), o=attn.o_proj.weight,
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), down=mlp.down_proj.weight,
            final_norm=head.norm.weight if eagle3 else None, lm_head=head.lm_head.weight,
            d2t=head.d2t if eagle3 else None, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim, eps=shape.rms_norm_eps, rope_theta=shape.rope_theta,
            norm_before_residual=spec.norm_before_residual)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:  # x [n, H], w [H]
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox rotary embedding: x [n, heads, head_dim], positions [n]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class StepMeta(NamedTuple):
    """One forward's attention inputs (one KV group); a tuple: built inside the compiled code."""
    query_start_loc: torch.Tensor  # [batch + 1] int32
    seq_lens: torch.Tensor  # [batch] int32
    block_table: torch.Tensor  # [batch, max_blocks] int32
    slots: torch.Tensor  # [num_tokens] int64
    cache_id: int  # _CACHES key
    block_size: int


def _layer(p: PeerWeights, attn_in: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
           meta: StepMeta) -> torch.Tensor:
    """attn_in [n, attn_in] -> the residual stream after attention and MLP [n, H]."""
    n = attn_in.shape[0]
    hq, hk, d = p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim, p.head_dim
    q, k, v = F.linear(attn_in, p.qkv).split([hq, hk, hk], dim=-1)
    q = _rope(q.reshape(n, p.num_heads, d), positions, p.rope_theta)
    k = _rope(k.reshape(n, p.num_kv_heads, d), positions, p.rope_theta)
    out = paged_attention(q, k, v.reshape(n, p.num_kv_heads, d).contiguous(), meta.query_start_loc, meta.seq_lens,
                          meta.block_table, meta.slots, meta.cache_id, meta.block_size)
    x = residual + F.linear(out.reshape(n, hq), p.o)
    gate, up = F.linear(_rms(x, p.post_norm, p.eps), p.gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, p.down)


def _head(p: PeerWeights, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
          meta: StepMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [n], hidden [n, H]) -> (the rows the lm_head reads, the rows carried to the next step)."""
    embeds = F.embedding(ids, p.embed)
    if p.method == "eagle3":
        normed = _rms(hidden, p.hidden_norm, p.eps)
        residual = normed if p.norm_before_residual else hidden
        x = _layer(p, torch.cat((_rms(embeds, p.input_norm, p.eps), normed), dim=-1), residual, positions, meta)
        return _rms(x, p.final_norm, p.eps), x
    x = F.linear(torch.cat((embeds, hidden), dim=-1), p.fc, p.fc_bias)
    x = _layer(p, x, x, positions, meta)  # EAGLE-1's first layer has no input norm
    return x, x


def _greedy(p: PeerWeights, h: torch.Tensor) -> torch.Tensor:  # [b, H] -> target ids [b] int64
    ids = F.linear(h, p.lm_head).argmax(dim=-1)
    return ids + p.d2t[ids] if p.d2t is not None else ids


def propose_step(
    p: PeerWeights,
    k: int,
    max_model_len: int,
    block_size: int,
    cache_id: int,  # the KV cache's key in _CACHES
    target_token_ids: torch.Tensor,  # [n] int
    target_positions: torch.Tensor,  # [n] int64
    target_hidden_states: torch.Tensor,  # [n, hidden input width]
    next_token_ids: torch.Tensor,  # [b] int
    query_start_loc: torch.Tensor,  # [b + 1] int32
    seq_lens: torch.Tensor,  # [b] int32
    block_table: torch.Tensor,  # [b, max_blocks] int32
    slot_mapping: torch.Tensor,  # [n] int64
    num_rejected_tokens: torch.Tensor,  # [b] int
) -> torch.Tensor:  # [b, k] int64 target ids
    """One greedy chain propose: first pass over every row, then k - 1 decode steps."""
    b = next_token_ids.shape[0]
    sample = query_start_loc[1:].long() - 1 - num_rejected_tokens.long()
    ids = torch.cat((target_token_ids[1:].long(), target_token_ids.new_zeros(1).long()))
    ids = ids.index_put((sample,), next_token_ids.long())
    hidden = F.linear(target_hidden_states, p.fc) if p.method == "eagle3" else target_hidden_states
    meta = StepMeta(query_start_loc, seq_lens, block_table, slot_mapping, cache_id, block_size)
    logit_h, carry = _head(p, ids, hidden, target_positions, meta)
    draft = _greedy(p, logit_h[sample])
    carry, pos = carry[sample], target_positions[sample].long()
    drafts = [draft]
    real = seq_lens > 0
    one_row_each = torch.arange(b + 1, dtype=torch.int32, device=draft.device)
    for _ in range(1, k):
        pos = pos + 1
        exceeds = pos >= max_model_len
        fed = torch.where(exceeds, 0, pos)
        lens = torch.where(exceeds, 1, pos + 1).masked_fill(~real, 0).to(torch.int32)
        block = block_table.gather(1, (fed // block_size)[:, None]).squeeze(1).long()
        slots = torch.where(real & ~exceeds, block * block_size + fed % block_size, PADDING_SLOT_ID)
        step_meta = StepMeta(one_row_each, lens, block_table, slots, cache_id, block_size)
        logit_h, carry = _head(p, draft, carry, fed, step_meta)
        draft = _greedy(p, logit_h)
        drafts.append(draft)
    return torch.stack(drafts, dim=1)


# ---------------------------------------------------------------------- compiled, captured
CALL_KEYS = ("target_token_ids", "target_positions", "target_hidden_states", "next_token_ids", "query_start_loc",
             "seq_lens", "block_table", "slot_mapping", "num_rejected_tokens")


def call_args(call: dict, max_blocks: int) -> tuple[torch.Tensor, ...]:
    """A bench call (drafter.tools.bench.grid.decode_call keywords, one KV group) as propose_step's tensors,
    the block table widened to max_blocks (one compiled shape for every context length)."""
    table = call["block_tables"][0]
    width = min(table.shape[1], max_blocks)
    wide = table.new_zeros(table.shape[0], max_blocks)
    wide[:, :width] = table[:, :width]
    values = dict(call, block_table=wide, slot_mapping=call["slot_mappings"][0])
    return tuple(values[key] for key in CALL_KEYS)


@dataclass
class PeerGraph:
    """One captured propose over one call's tensors (kept alive here: the graph reads them)."""
    graph: torch.cuda.CUDAGraph
    args: tuple[torch.Tensor, ...]
    drafts: torch.Tensor  # [batch, k] int64, rewritten by each replay

    def replay(self) -> None:
        self.graph.replay()


class CompiledPeer:
    """propose_step compiled (one specialisation per call shape) and, on a GPU, captured."""

    def __init__(self, head, spec, engine, compile_options: dict | None = None):
        """head: the engine's head (the fused path keeps the modules' weights); engine: its KV
        cache (copied), k, max_model_len, block size and block table width.
        compile_options: torch.compile's keywords (None: inductor's default mode); {"eager": True}
        runs propose_step uncompiled (tests)."""
        cfg = engine.config
        self.weights = peer_weights(head, spec)
        self.kv_cache = engine.kv.layers[0].clone()  # [2, num_blocks, block_size, kv_heads, head_dim]
        self.cache_id = next(_CACHE_IDS)
        _CACHES[self.cache_id] = self.kv_cache
        self.k, self.max_model_len = cfg.num_speculative_tokens, cfg.max_model_len
        self.block_size, self.max_blocks = cfg.kv_groups[0].block_size, cfg.max_blocks_per_req[0]
        self.device = engine.device
        options = dict(compile_options or {})
        if options.pop("eager", False):
            self.fn = self._step
        else:
            _allow_recompiles()
            self.fn = torch.compile(self._step, fullgraph=True, dynamic=False, **options)
        self.pool = self.stream = None
        self.graphs: list[PeerGraph] = []  # kept: a pool whose graphs are all gone takes no new capture

    def close(self) -> None:
        """Drop the graphs and the KV copy (the op's registry holds it otherwise)."""
        self.graphs.clear()
        _CACHES.pop(self.cache_id, None)

    def _step(self, *args: torch.Tensor) -> torch.Tensor:
        return propose_step(self.weights, self.k, self.max_model_len, self.block_size, self.cache_id, *args)

    @torch.inference_mode()
    def propose(self, call: dict) -> torch.Tensor:
        """Drafts [batch, k] of one call (compiled, not captured)."""
        return self.fn(*call_args(call, self.max_blocks))

    @torch.inference_mode()
    def capture(self, call: dict) -> PeerGraph:
        """One CUDA graph of the compiled step over this call's tensors, read in place, on this
        peer's own stream and pool (drafter.kernels.cuda_timing.private_stream says why)."""
        from drafter.kernels.cuda_timing import private_stream

        args = call_args(call, self.max_blocks)
        if self.pool is None:
            self.pool, self.stream = torch.cuda.graph_pool_handle(), private_stream(self.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside capture
            for _ in range(2):
                self.fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            drafts = self.fn(*args)
        self.graphs.append(PeerGraph(graph, args, drafts))
        return self.graphs[-1]


def _allow_recompiles(limit: int = 64) -> None:
    """One compiled specialisation per (tokens, batch): more than dynamo's default 8 in a grid."""
    import torch._dynamo.config as dc

    for name in ("recompile_limit", "cache_size_limit"):
        if getattr(dc, name, limit) < limit:
            setattr(dc, name, limit)


# ---------------------------------------------------------------------- in drafter bench
def make_peer(head, spec, engine, log) -> CompiledPeer | None:
    """The bench's peer for this engine, or None (logged) for a head it does not cover."""
    try:
        return CompiledPeer(head, spec, engine)
    except ValueError as exc:
        log(f"  no compiled peer: {exc}")
        return None


def peer_row(peer: CompiledPeer, call: dict, engine_drafts: torch.Tensor, iters: int) -> dict:
    """One bench row's peer figures: its captured step timed as the engine's call is (events
    around each replay on an idle GPU: peer_us; replays back to back: peer_replay_us), the
    seconds its compile + capture took, and the share of its drafts equal to the engine's
    (bf16 rounding differs between the two, so a near-tie may go either way)."""
    import statistics
    import time

    from drafter.tools.bench.grid import time_events

    t0 = time.perf_counter()
    graph = peer.capture(call)
    graph.replay()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    agree = (graph.drafts == engine_drafts).float().mean().item()
    return {"peer_us": statistics.median(time_events(graph.replay, iters)),
            "peer_replay_us": statistics.median(time_events(graph.replay, iters, sync_each=False)),
            "peer_capture_s": seconds, "peer_drafts_agree": agree}
