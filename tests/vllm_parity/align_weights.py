"""Bias a make-tiny target + head pair so that drafts are *partially* accepted.

make-tiny's random heads are (almost) never accepted by its random target, so vLLM's padded
batches then always carry k rejected tokens and the interesting rows (sample index in the middle
of a request, 0 < rejected < k) never occur.  This rewrites a few tensors of a make-tiny output
dir in place, keeping its layout and config: the target mostly continues token t with t+1 (its
lm_head row v resembles embed[v-1]), the head guesses that rule from its embedding input
(EAGLE-1) or from the target state (EAGLE-3), and `--alpha` scales the layers' residual
contributions so that the rule holds often but not always.

    python align_weights.py DIR --method eagle|eagle3 [--alpha 1.0] [--seed 0]
DIR holds `target/` and `head/` as written by `write_tiny`.
"""
from __future__ import annotations

import argparse
import os

import torch
from safetensors.torch import load_file, save_file


def _edit(path, fn):
    f = os.path.join(path, "model.safetensors")
    w = load_file(f)
    fn(w)
    save_file({k: v.contiguous() for k, v in w.items()}, f)


def _shrink_layers(w, alpha, prefix=""):
    for k in list(w):
        if k.startswith(prefix) and (k.endswith("o_proj.weight") or k.endswith("down_proj.weight")):
            w[k] = w[k] * alpha


def align(root: str, method: str, alpha: float = 1.0, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    tgt, head = os.path.join(root, "target"), os.path.join(root, "head")
    emb = load_file(os.path.join(tgt, "model.safetensors"))["model.embed_tokens.weight"]
    vocab, hidden = emb.shape

    def target(w):
        _shrink_layers(w, alpha, "model.layers.")
        w["lm_head.weight"] = torch.roll(emb, 1, 0) + 0.3 * torch.randn(vocab, hidden, generator=g)

    _edit(tgt, target)

    def head_fn(w):
        _shrink_layers(w, alpha)
        fc = w["fc.weight"]
        eye = torch.zeros_like(fc)
        eye[:, :hidden] = torch.eye(hidden)
        w["fc.weight"] = eye + 0.05 * torch.randn(fc.shape, generator=g)
        if method == "eagle3":
            keep = torch.arange(w["d2t"].shape[0]) + w["d2t"]  # draft id -> target id
            # from the state of token t (aux ids >= 1 carry embed[t]) guess t+2
            w["lm_head.weight"] = (torch.roll(emb, 2, 0)[keep]
                                   + 0.3 * torch.randn(keep.shape[0], hidden, generator=g))

    _edit(head, head_fn)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("--method", required=True, choices=["eagle", "eagle3"])
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    align(a.root, a.method, a.alpha, a.seed)
