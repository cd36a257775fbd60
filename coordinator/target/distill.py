"""Train a tiny target + draft head pair on CPU in seconds, so that speculation really accepts.

    report = train_pair(out_dir, DistillConfig(method="eagle3"))   # out_dir/target + out_dir/head

Why two stages.  write_tiny's random target maps a context to its next token chaotically: a
one-layer head distilled on it for 300 steps reached ~1.5% held-out accuracy (measured here),
so acceptance stayed at ~0 and the accepting branches of verification went untested.  So the
target first learns a synthetic corpus with structure (a sparse Markov chain over its vocabulary:
a few hundred SGD steps turn it into a small language model), then the head is distilled on that
target's own hidden states and greedy predictions, unrolled over k draft steps the way the
proposer chains them ("training-time test", as EAGLE-3 trains).  This is DESIGN section 6's
"target + head pair trained here": no hub weights, everything written under out_dir.

The dense backends below exist only for training: they are differentiable and batch equal-length
sequences; serving and verification use the paged ReferenceBackend.
"""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from drafter.models.loader import load_head, load_target
from drafter.models.tiny import TinySizes, write_tiny

DISTILL_METHODS = ("eagle", "eagle3")


@dataclass(frozen=True)
class DistillConfig:
    method: str = "eagle3"
    seed: int = 0
    sizes: TinySizes = TinySizes()
    # the corpus: token a is followed by one of `successors` tokens with these probabilities
    successor_probs: tuple[float, ...] = (0.6, 0.2, 0.05, 0.05, 0.05, 0.05)
    target_steps: int = 80
    target_batch: int = 16
    target_seq_len: int = 32
    target_lr: float = 3e-2
    # distillation data: greedy continuations of random prompts
    # many short sequences: random prompts make the head see every token as context, the
    # continuations teach it the target's greedy paths (few long ones only cover the attractors)
    num_sequences: int = 256
    prompt_len: int = 16
    continuation_len: int = 16
    head_steps: int = 100
    head_batch: int = 16
    head_lr: float = 1e-2
    unroll: int = 3  # draft steps trained jointly (the chain's k)
    threads: int = 1  # tiny matmuls: one thread beats two that fight over 2 cores

    def __post_init__(self):
        if self.method not in DISTILL_METHODS:
            raise ValueError(f"distillation supports {DISTILL_METHODS}, got {self.method!r}")
        if abs(sum(self.successor_probs) - 1.0) > 1e-6:
            raise ValueError("successor_probs must sum to 1")


@dataclass(frozen=True)
class DistillReport:
    method: str
    target_loss: float  # final training loss of the target on the corpus
    corpus_entropy: float  # the loss floor (nats)
    head_accuracy: tuple[float, ...]  # held out, per draft position: P(d_j right | d_1..d_{j-1} right)
    expected_acceptance_length: float  # 1 + sum_j P(d_1..d_j all right), greedy, held out
    seconds: float

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


# --------------------------------------------------------------------------- dense backends
def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:  # [B, T, kv_heads, D] -> [B, T, heads, D]
    return x.repeat_interleave(heads // x.shape[2], dim=2)


class _DenseBackend:
    """Causal attention over `batch` equal-length sequences laid out flat ([batch * len]).

    With cache=True every call's keys are appended per layer handle, so generation feeds one new
    token per sequence per call.  The handle is whatever the model passes as the layer's kv cache
    (train_pair passes the layer index)."""

    def __init__(self, batch: int, cache: bool = False):
        self.batch = batch
        self.cache = {} if cache else None

    def forward(self, q, k, v, handle, meta, sliding_window=None):  # q: [B*n, H, D]; k, v: [B*n, KH, D]
        b = self.batch
        n, heads, dim = q.shape[0] // b, q.shape[1], q.shape[2]
        q, k, v = q.view(b, n, heads, dim), k.view(b, n, -1, dim), v.view(b, n, -1, dim)
        if self.cache is not None:
            if handle in self.cache:
                old_k, old_v = self.cache[handle]
                k, v = torch.cat([old_k, k], 1), torch.cat([old_v, v], 1)
            self.cache[handle] = (k, v)
        s = k.shape[1]
        q_pos = torch.arange(s - n, s)[:, None]
        k_pos = torch.arange(s)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        out = F.scaled_dot_product_attention(q.transpose(1, 2), _expand_kv(k, heads).transpose(1, 2),
                                             _expand_kv(v, heads).transpose(1, 2), attn_mask=mask)
        return out.transpose(1, 2).reshape(b * n, heads, dim)


class _UnrolledBackend:
    """Attention for k unrolled draft steps over every row at once (training-time test).

    Row t of step 0 is the first pass at position t: it sees step 0's keys 0..t.  Row t of step j
    is chain step j for a request whose last accepted token sits at t: position t + j sees the
    first pass's keys 0..t plus the keys steps 1..j wrote for that same row, as in the proposer."""

    def __init__(self, batch: int, length: int):
        self.batch, self.length = batch, length
        self.steps: dict = {}

    def forward(self, q, k, v, handle, meta, sliding_window=None):  # q: [B*T, H, D]; k, v: [B*T, KH, D]
        b, t = self.batch, self.length
        heads, dim = q.shape[1], q.shape[2]
        q = q.view(b, t, heads, dim)
        k = _expand_kv(k.view(b, t, -1, dim), heads)
        v = _expand_kv(v.view(b, t, -1, dim), heads)
        history = self.steps.setdefault(handle, [])
        history.append((k, v))
        k0, v0 = history[0]
        scale = dim ** -0.5
        scores = torch.einsum("bthd,bshd->bhts", q, k0) * scale
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        own = [(q * kj).sum(-1).transpose(1, 2)[..., None] * scale for kj, _ in history[1:]]  # [B, H, T, 1]
        probs = torch.cat([scores] + own, dim=-1).softmax(-1)
        out = torch.einsum("bhts,bshd->bthd", probs[..., :t], v0)
        for j, (_, vj) in enumerate(history[1:]):
            out = out + probs[..., t + j].transpose(1, 2)[..., None] * vj
        return out.reshape(b * t, heads, dim)


# --------------------------------------------------------------------------- stage 1: the target
def _markov_chain(vocab: int, probs: tuple[float, ...], g: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(vocab, generator=g)[: len(probs)] for _ in range(vocab)])  # [V, S]


def _sample_corpus(successors: torch.Tensor, probs: torch.Tensor, n: int, length: int,
                   g: torch.Generator) -> torch.Tensor:  # [n, length]
    x = torch.empty(n, length, dtype=torch.long)
    x[:, 0] = torch.randint(0, successors.shape[0], (n,), generator=g)
    choice = torch.multinomial(probs.expand(n * length, -1), 1, replacement=True, generator=g).view(n, length)
    for i in range(1, length):
        x[:, i] = successors[x[:, i - 1], choice[:, i]]
    return x


def _train_target(target, cfg: DistillConfig, g: torch.Generator) -> float:
    successors = _markov_chain(cfg.sizes.vocab_size, cfg.successor_probs, g)
    probs = torch.tensor(cfg.successor_probs)
    handles = list(range(len(target.layers)))
    b, t = cfg.target_batch, cfg.target_seq_len
    positions = torch.arange(t).repeat(b)
    opt = torch.optim.AdamW(target.parameters(), lr=cfg.target_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.target_lr, total_steps=cfg.target_steps, pct_start=0.1)
    target.train()
    loss = torch.tensor(float("nan"))
    for _ in range(cfg.target_steps):
        x = _sample_corpus(successors, probs, b, t + 1, g)
        out = target(x[:, :-1].reshape(-1), positions, handles, [None], _DenseBackend(b))
        loss = F.cross_entropy(out.logits, x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    target.eval()
    return float(loss.detach())


def _save_target(target, out: Path) -> None:
    weights = {(k if k.startswith("lm_head") else "model." + k): v.detach().contiguous()
               for k, v in target.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"))


# --------------------------------------------------------------------------- stage 2: the head
@dataclass
class _Data:
    tokens: torch.Tensor  # [N, L] prompt + greedy continuation
    labels: torch.Tensor  # [N, L] the target's greedy prediction after each position
    hidden: torch.Tensor  # [N, L, H] final-normed hidden states
    aux: torch.Tensor  # [N, L, n_aux * H] aux hidden states


@torch.inference_mode()
def _greedy_data(target, cfg: DistillConfig, aux_ids: tuple[int, ...], n: int, g: torch.Generator) -> _Data:
    vocab = cfg.sizes.vocab_size
    handles = list(range(len(target.layers)))
    tokens = torch.randint(0, vocab, (n, cfg.prompt_len), generator=g)
    backend = _DenseBackend(n, cache=True)
    fresh = tokens
    for _ in range(cfg.continuation_len):
        start = tokens.shape[1] - fresh.shape[1]
        out = target(fresh.reshape(-1), torch.arange(start, tokens.shape[1]).repeat(n), handles, [None], backend)
        nxt = out.logits.view(n, fresh.shape[1], -1)[:, -1].argmax(-1)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        fresh = nxt[:, None]
    length = tokens.shape[1]
    out = target(tokens.reshape(-1), torch.arange(length).repeat(n), handles, [None], _DenseBackend(n), aux_ids)
    aux = out.aux_hidden_states if aux_ids else out.hidden_states[:, :0]
    return _Data(tokens, out.logits.view(n, length, -1).argmax(-1), out.hidden_states.view(n, length, -1),
                 aux.view(n, length, -1))


def _draft_vocab(head, data: _Data, vocab: int) -> torch.Tensor:
    """EAGLE-3's reduced vocabulary: the tokens the target predicts most often (as real EAGLE-3
    heads are built), topped up with the smallest unused ids; returns the new d2t offsets."""
    size = head.d2t.shape[0]
    counts = collections.Counter(data.labels.reshape(-1).tolist())
    chosen = [tok for tok, _ in counts.most_common(size)]
    taken = set(chosen)
    chosen += [tok for tok in range(vocab) if tok not in taken][: size - len(chosen)]
    chosen_t = torch.tensor(sorted(chosen))
    return chosen_t - torch.arange(size)


def _unrolled_loss(head, method: str, data: _Data, rows: torch.Tensor, unroll: int, target_to_draft: torch.Tensor):
    """Cross entropy of every row's k chained drafts; returns (loss, per-step hit masks)."""
    tokens, labels = data.tokens[rows], data.labels[rows]
    hidden = data.aux[rows] if method == "eagle3" else data.hidden[rows]
    b, length = tokens.shape
    t = length - unroll  # row r's step j reads token r + j + 1 and predicts labels[r + j + 1]
    backend = _UnrolledBackend(b, t)
    handles = list(range(len(head.layers)))
    carry = head.combine_hidden_states(hidden[:, :t].reshape(b * t, -1))
    loss = torch.zeros(())
    hits = []
    for j in range(unroll):
        ids = tokens[:, j + 1: j + 1 + t].reshape(-1)
        positions = (torch.arange(t) + j).repeat(b)
        logit_h, carry = head(ids, positions, carry, handles, [None], backend, step=j)
        logits = head.compute_logits(logit_h, j)  # [b * t, head vocab]
        want = labels[:, j + 1: j + 1 + t].reshape(-1)
        loss = loss + F.cross_entropy(logits, target_to_draft[want], ignore_index=-100)
        hits.append((head.draft_to_target(logits.argmax(-1)) == want).view(b, t))
    return loss / unroll, hits


def _train_head(head, method: str, data: _Data, cfg: DistillConfig, target_to_draft, g: torch.Generator) -> None:
    shared = {"embed_tokens.weight"} | ({"lm_head.weight"} if method == "eagle" else set())
    params = [p for name, p in head.named_parameters() if name not in shared]
    for name, p in head.named_parameters():
        p.requires_grad_(name not in shared)
    opt = torch.optim.AdamW(params, lr=cfg.head_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.head_lr, total_steps=cfg.head_steps, pct_start=0.1)
    head.train()
    for _ in range(cfg.head_steps):
        rows = torch.randint(0, data.tokens.shape[0], (cfg.head_batch,), generator=g)
        loss, _ = _unrolled_loss(head, method, data, rows, cfg.unroll, target_to_draft)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    head.eval()


@torch.inference_mode()
def _held_out_accuracy(head, method, data: _Data, cfg: DistillConfig, target_to_draft) -> tuple[float, ...]:
    """Per draft position, on generated rows only: P(draft j right | drafts before it right)."""
    rows = torch.arange(data.tokens.shape[0])
    _, hits = _unrolled_loss(head, method, data, rows, cfg.unroll, target_to_draft)
    t = hits[0].shape[1]
    generated = torch.arange(t)[None, :] >= cfg.prompt_len - 1  # the drafted continuation, not the prompt
    alive = generated.expand_as(hits[0]).clone()
    acc = []
    for h in hits:
        acc.append(float((h & alive).sum()) / max(1, int(alive.sum())))
        alive &= h
    return tuple(acc)


def _save_head(head, method: str, head_dir: Path) -> None:
    skip = {"embed_tokens.weight"} | ({"lm_head.weight"} if method == "eagle" else set())
    weights = {k: v.detach().contiguous() for k, v in head.state_dict().items() if k not in skip}
    if method == "eagle3":
        t2d = torch.zeros(head.spec.vocab_size, dtype=torch.bool)
        t2d[torch.arange(head.d2t.shape[0]) + head.d2t] = True
        weights["t2d"] = t2d
    old = load_file(str(head_dir / "model.safetensors"))
    missing = sorted(set(old) - set(weights))
    if missing:
        raise RuntimeError(f"trained head lacks tensors of the original layout: {missing[:5]}")
    save_file(weights, str(head_dir / "model.safetensors"))


# --------------------------------------------------------------------------- entry point
def train_pair(out_dir: str | Path, cfg: DistillConfig = DistillConfig()) -> DistillReport:
    """Write a tiny pair under out_dir (target/, head/), train the target, distill the head.

    Idempotent per directory: a finished run leaves out_dir/distill.json and is not redone."""
    out = Path(out_dir)
    done = out / "distill.json"
    if done.exists():
        return DistillReport(**{k: tuple(v) if isinstance(v, list) else v
                                for k, v in json.loads(done.read_text()).items()})
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        write_tiny(cfg.method, out, seed=cfg.seed, sizes=cfg.sizes)
        g = torch.Generator().manual_seed(cfg.seed)
        target = load_target(out / "target")
        target_loss = _train_target(target, cfg, g)
        _save_target(target, out / "target")
        for p in target.parameters():
            p.requires_grad_(False)
        head = load_head(out / "head", cfg.method, out / "target")
        aux_ids = head.spec.aux_layer_ids if cfg.method == "eagle3" else ()
        train = _greedy_data(target, cfg, aux_ids, cfg.num_sequences, g)
        held_out = _greedy_data(target, cfg, aux_ids, max(16, cfg.num_sequences // 4), g)
        vocab = cfg.sizes.vocab_size
        target_to_draft = torch.arange(vocab)
        if cfg.method == "eagle3":
            head.d2t.copy_(_draft_vocab(head, train, vocab))
            target_to_draft = torch.full((vocab,), -100, dtype=torch.long)
            draft_ids = torch.arange(head.d2t.shape[0]) + head.d2t
            target_to_draft[draft_ids] = torch.arange(head.d2t.shape[0])
            with torch.no_grad():  # start the head's own output layer from the target's (common practice)
                head.lm_head.weight.copy_(target.lm_head.weight[draft_ids])
                head.norm.weight.copy_(target.norm.weight)
        with torch.enable_grad():
            _train_head(head, cfg.method, train, cfg, target_to_draft, g)
        acc = _held_out_accuracy(head, cfg.method, held_out, cfg, target_to_draft)
        _save_head(head, cfg.method, out / "head")
    finally:
        torch.set_num_threads(threads)
    alive, expected = 1.0, 1.0
    for a in acc:
        alive *= a
        expected += alive
    probs = torch.tensor(cfg.successor_probs)
    report = DistillReport(cfg.method, target_loss, float(-(probs * probs.log()).sum()), acc, expected,
                           time.perf_counter() - start)
    done.write_text(report.to_json() + "\n")
    return report


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="train a tiny target + draft head pair on CPU")
    p.add_argument("out")
    p.add_argument("--method", default="eagle3", choices=DISTILL_METHODS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(train_pair(args.out, replace(DistillConfig(), method=args.method, seed=args.seed)).to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
