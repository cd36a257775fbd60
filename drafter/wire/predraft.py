"""Pre-drafts: the next step's drafts, computed before the target has verified this step's.

After a draft d_1..d_k from a request's last accepted row (position p), the target's verification
ends in an outcome (a, b): drafts d_1..d_a accepted, then the target's own token b at position
p + a + 2 (the corrected token, or the bonus when a = k).  A drafter with idle time drafts the
next step for the likeliest outcomes in advance (drafter.engine.predraft); the target, once it
knows (a, b), looks the outcome up (`lookup`) and verifies those drafts at once.  A miss, a
pre-draft for another call, or one conditioned on other drafts than the target verified is never
used: the step drafts exactly as without pre-drafting.

Both ends read a call the same way (`outcomes_of_call`), so the drafter can tell which pre-draft
the target picked without being told.  This module is neutral: records and pure functions over
CPU tensors, no engine, no transport.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter.wire.records import ProposeInputs


@dataclass(frozen=True)
class PreDrafts:
    """One propose call's pre-drafts, row for row in that call's batch order."""

    step: int  # the caller's id of the propose call these follow (a pick for any other call ignores them)
    block_ids: torch.Tensor  # [batch] int64: each row's first block (KV group 0), the request's key
    positions: torch.Tensor  # [batch] int64: p, the position of the row the call drafted from
    conditioned_on: torch.Tensor  # [batch, k] int64: the drafts of that call the target verifies
    accepted: torch.Tensor  # [batch, outcomes] int64: a of each predicted outcome, -1 = no outcome
    next_tokens: torch.Tensor  # [batch, outcomes] int64: b of each predicted outcome
    drafts: torch.Tensor  # [batch, outcomes, k'] int64: the next step's drafts for that outcome
    # [batch, outcomes] float32: the head's joint log-probability (the rank); None once pushed
    log_probs: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.block_ids.shape[0])

    @property
    def num_outcomes(self) -> int:
        return int(self.accepted.shape[1])

    def row_of(self, block_id: int, position: int) -> int | None:
        """The row drafted for the request keyed (block_id, position), if any (the first such row)."""
        got = self.index().get((block_id, position))
        return None if got is None else got[0]

    def index(self) -> dict:
        """{(block id, position): (row, the drafts assumed verified, {(a, b): outcome})}, the first
        row of a key and the first outcome of a pair, built once per set from Python lists: a
        pick looks each row up in a few dictionary reads instead of tensor ops."""
        got = self.__dict__.get("_index")
        if got is None:
            got = {}
            cond, acc, nxt = self.conditioned_on.tolist(), self.accepted.tolist(), self.next_tokens.tolist()
            for r, key in enumerate(zip(self.block_ids.tolist(), self.positions.tolist())):
                if key not in got:
                    outs: dict = {}
                    for i, pair in enumerate(zip(acc[r], nxt[r])):
                        outs.setdefault(pair, i)
                    got[key] = (r, tuple(cond[r]), outs)
            object.__setattr__(self, "_index", got)  # frozen: a cache beside the fields
        return got


@dataclass(frozen=True)
class Outcome:
    """How the target's verification ended for one row of the next call."""

    block_id: int  # the request's first block (KV group 0)
    position: int  # p: the position of the row the previous call drafted from
    accepted: int  # a: drafts accepted
    next_token: int  # b: the token the target sampled after them
    verified: tuple[int, ...]  # the j drafts the target verified (a <= j)


def outcomes_of_call(inp: ProposeInputs,
                     accepted_counts: torch.Tensor | None,  # [batch] int, -1 = nothing verified
                     ) -> list[Outcome | None]:
    """Read each row's verification outcome off a padded-batch propose call: a from the
    acceptance report, j = a + rejected rows, the verified drafts are the last j query tokens,
    and the sampled row sits at position p + 1 + a.  None where the row verified nothing."""
    if accepted_counts is None or inp.num_rejected_tokens is None:
        return [None] * inp.batch_size
    qsl = inp.query_start_loc.tolist()
    rejected = inp.num_rejected_tokens.tolist()
    accepted = accepted_counts.tolist()
    ids = inp.target_token_ids
    out: list[Outcome | None] = []
    for r in range(inp.batch_size):
        a, hi = int(accepted[r]), qsl[r + 1]
        j = a + int(rejected[r])
        if a < 0 or hi - qsl[r] < j + 1:
            out.append(None)
            continue
        sampled = int(inp.target_positions[hi - 1 - int(rejected[r])])
        out.append(Outcome(int(inp.block_tables[0][r, 0]), sampled - 1 - a, a, int(inp.next_token_ids[r]),
                           tuple(int(t) for t in ids[hi - j: hi].tolist())))
    return out


def lookup(pre: PreDrafts | None, outcome: Outcome | None) -> torch.Tensor | None:  # [k'] int64 | None
    """The pre-draft for this outcome, or None (a miss): same request and row, the same drafts
    verified as the ones the pre-drafts assumed, and (a, b) among the predicted outcomes."""
    if pre is None or outcome is None:
        return None
    got = pre.index().get((outcome.block_id, outcome.position))
    if got is None:
        return None
    row, assumed, outs = got
    j = len(outcome.verified)
    if j > len(assumed) or assumed[:j] != outcome.verified:
        return None
    i = outs.get((outcome.accepted, outcome.next_token))
    return None if i is None or outcome.accepted < 0 else pre.drafts[row, i]


def merge(exact: torch.Tensor,  # [batch, k] int64: the drafter's exact drafts for the call
          hits: list[torch.Tensor | None]) -> tuple[torch.Tensor, list[bool]]:
    """The drafts the target verifies, [batch, max(k, k')] int64: a hit's pre-draft in its row (all
    k' of it: deeper pre-drafts are verified whole), the exact drafts elsewhere, padded with -1 (no
    draft) where the width exceeds k; and which rows were hits.  Both ends compute it, from the
    same pre-drafts."""
    k = exact.shape[1]
    width = max([k] + [int(h.shape[0]) for h in hits if h is not None])
    used = torch.full((exact.shape[0], width), -1, dtype=exact.dtype, device=exact.device)
    used[:, :k] = exact
    flags = []
    for r, h in enumerate(hits):
        flags.append(h is not None)
        if h is not None:
            used[r, : h.shape[0]] = h.to(used.device, used.dtype)
    return used, flags


def verifies_predrafts(hits: list, min_hits: float = 0.0) -> bool:
    """A bound step's rule (both ends apply it to the same lookups): the target verifies its hit
    rows' pre-drafts, sending the step without waiting, when every row hit, or when min_hits > 0
    and at least that share of the rows (and at least one) hit, its missed rows then verifying no
    drafts; otherwise it waits and verifies the step's exact drafts in every row (drafted from
    the target's own hidden states: better than a pre-draft once the step waits anyway)."""
    got = sum(h is not None for h in hits)
    if not hits or got == len(hits):
        return bool(hits)
    return min_hits > 0 and got >= max(1.0, min_hits * len(hits))


# --------------------------------------------------------------------------- on the wire (ZMQ push)
# field -> dimensions; every one int64 token ids or positions, batch first
PUSH_FIELDS = {"block_ids": 1, "positions": 1, "conditioned_on": 2, "accepted": 2, "next_tokens": 2, "drafts": 3}


def push_to_frames(pre: PreDrafts, session_id: str, epoch: int):
    """(schema.PreDraftPush header, tensor frames): token ids only, no scores."""
    from drafter.wire import schema
    from drafter.wire.tensors import tensor_to_frames

    frames: list = []
    refs = {name: tensor_to_frames(getattr(pre, name).to(torch.int64).contiguous(), frames) for name in PUSH_FIELDS}
    return schema.PreDraftPush(request_id=pre.step, session_id=session_id, epoch=epoch, **refs), frames


def push_from_frames(header, frames: list) -> PreDrafts:
    """A received push, every tensor checked (dtype, dimensions, bytes, one batch size); raises
    InvalidInput naming the field."""
    from drafter.wire.errors import invalid
    from drafter.wire.tensors import INT, decode_tensor

    values = {}
    for name, ndim in PUSH_FIELDS.items():
        ref = getattr(header, name)
        if ref is None:
            raise invalid(name, "missing")
        if ref.frame >= len(frames):
            raise invalid(name, f"frame {ref.frame} does not exist")
        f = frames[ref.frame]
        values[name] = decode_tensor(name, ref.dtype, ref.shape, f.buffer if hasattr(f, "buffer") else f, ndim,
                                     INT).long()
    batch = values["block_ids"].shape[0]
    for name, t in values.items():
        if t.shape[0] != batch:
            raise invalid(name, f"{t.shape[0]} rows, block_ids has {batch}")
    outcomes = values["accepted"].shape[1]
    if values["next_tokens"].shape[1] != outcomes or values["drafts"].shape[1] != outcomes:
        raise invalid("drafts", "accepted, next_tokens and drafts must list the same outcomes")
    return PreDrafts(int(header.request_id), **values)


# --------------------------------------------------------------------------- on a bound session
# A bound step that asks (StepHeader.want_predrafts) is followed by one push frame on the channel
# its StepDone took (the binding's doorbell or data socket): BOUND_PUSH, then the msgpack of a
# BoundPush, which is the unbound push's PreDraftPush header with its tensor frames carried inline
# (Tensor.frame indexes BoundPush.frames).  0xc1 begins no msgpack record, so no StepDone frame
# starts so, and the doorbell's WAKE is that byte alone.
BOUND_PUSH = b"\xc1P"
# The target's word, on the doorbell, that it holds an awaited step's drafts (TAKEN + the step, 8 bytes
# little-endian): the drafter starts that step's pre-draft work only then, never while the target still
# reads the step's output (drafter.service.predraft.BoundPreDrafts).  Like WAKE, it begins no msgpack
# record and asks for no reply.
TAKEN = b"\xc1T"


def taken_frame(step: int) -> bytes:
    """TAKEN for `step`."""
    return TAKEN + int(step).to_bytes(8, "little")


def taken_step(frame) -> int | None:
    """The step a TAKEN frame names; None for any other frame."""
    if len(frame) != len(TAKEN) + 8 or bytes(frame[:2]) != TAKEN:
        return None
    return int.from_bytes(bytes(frame[2:]), "little")


def _bound_push_type():
    """BoundPush(push: schema.PreDraftPush, frames: list[bytes]), array-like, unknown fields refused."""
    import msgspec

    from drafter.wire import schema

    return msgspec.defstruct("BoundPush", [("push", schema.PreDraftPush), ("frames", list[bytes])],
                             array_like=True, forbid_unknown_fields=True)


_BOUND = None


def _bound():
    global _BOUND
    if _BOUND is None:
        import msgspec

        cls = _bound_push_type()
        _BOUND = (cls, msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(cls))
    return _BOUND


def is_bound_push(frame) -> bool:
    """Whether a frame read where a StepDone may come is a pushed pre-draft set instead."""
    return bytes(frame[:2]) == BOUND_PUSH


def bound_push_frame(pre: PreDrafts, session_id: str, epoch: int) -> bytes:
    """One frame: BOUND_PUSH + the push header and its tensors' bytes (token ids only)."""
    cls, enc, _ = _bound()
    header, frames = push_to_frames(pre, session_id, epoch)
    return BOUND_PUSH + enc.encode(cls(header, [bytes(memoryview(f)) for f in frames]))


def bound_push_from_frame(frame) -> tuple[PreDrafts, str, int]:
    """(pre-drafts, session id, epoch) of a push frame, every tensor checked as push_from_frames
    checks them; DrafterError INVALID_ARGUMENT naming the field (or "push" for a frame that does not
    decode)."""
    from drafter.wire.errors import invalid

    _, _, dec = _bound()
    try:
        msg = dec.decode(bytes(frame[len(BOUND_PUSH):]))
    except Exception as exc:  # noqa: BLE001 - msgspec names the path
        raise invalid("push", str(exc)) from None
    return push_from_frames(msg.push, msg.frames), msg.push.session_id, int(msg.push.epoch)
