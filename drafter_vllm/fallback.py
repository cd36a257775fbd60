"""What a step gets when the drafter gives nothing usable: drafts that cannot change the output.

vLLM 0.32's padded drafter batch has no way to say "no drafts for this step": the runner expects
[batch, k] token ids, schedules all of them and verifies them with the target.  Verification is
lossless for *any* draft token (greedy: only tokens equal to the target's own choice are kept;
sampling: rejection sampling against a one-hot draft distribution reproduces the target's
distribution), so a fail-closed step only costs acceptance, never output.  The ids must still
be valid vocabulary ids, because the next step feeds them to the target's embedding.
We repeat each request's next token: always a valid id (the target just produced it, or it is
the request's own next prompt token for a partial prefill), and the same choice on every TP rank.
vLLM itself uses token 0 when it skips its drafter; repeating the next token is just as safe and
sometimes accepted (repetitive text).
"""

from __future__ import annotations

import torch


def fallback_drafts(next_token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """[batch] -> [batch, k] int64 on the same device."""
    return next_token_ids.to(torch.int64).reshape(-1, 1).expand(-1, k).contiguous()


def usable_drafts(drafts, batch: int, k: int, vocab_size: int) -> str | None:
    """Why drafts from the drafter cannot be handed to vLLM (None: they can).

    A drafter is another process: a bug or a mismatched head there must not make the target
    index its embedding out of range or mis-shape its batch."""
    if not isinstance(drafts, torch.Tensor):
        return f"not a tensor: {type(drafts).__name__}"
    if drafts.dim() != 2 or drafts.shape[0] != batch or drafts.shape[1] < k:
        return f"shape {tuple(drafts.shape)}, expected ({batch}, >={k})"
    if drafts.dtype.is_floating_point or drafts.dtype == torch.bool or drafts.is_complex():
        return f"dtype {drafts.dtype}"
    if drafts.numel() and (int(drafts.min()) < 0 or int(drafts.max()) >= vocab_size):
        return f"token id outside [0, {vocab_size})"
    return None
