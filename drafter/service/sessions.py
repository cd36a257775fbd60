"""Sessions: one per attached target worker, each with its own slice of the engine's KV pool.

The engine owns one pool per KV group, sized by the server config.  A session gets a contiguous
block range [base, base + num_blocks) in every group; the target addresses it with its own
block ids 0..num_blocks-1, which are checked against the session's num_blocks and then shifted
by base before they reach the engine.  That shift is the isolation: a session can name no block
outside its range, so it can neither read nor overwrite another session's KV.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from drafter.engine.inputs import out_of_range
from drafter.wire import schema
from drafter.wire.cuda_ref import FIELD as IPC_FIELD
from drafter.wire.errors import Code, DrafterError, invalid
from drafter.wire.records import Caller, ProposeInputs, ProposeRequest
from drafter.wire.tensors import DTYPES

PROTOCOL_VERSION = 1
PROBS_HEADROOM = 64 * 1024  # bytes a response needs besides the probabilities


@dataclass(frozen=True)
class EngineDescription:
    """What the loaded engine serves, in plain values (sessions are checked against it)."""

    method: str
    num_speculative_tokens: int
    speculative_token_tree: tuple[tuple[int, ...], ...] | None
    dtype: str
    hidden_size: int  # the target's hidden size
    num_aux_layers: int  # 0: the target's final hidden state
    aux_layer_ids: tuple[int, ...]
    hidden_width: int  # columns of target_hidden_states
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_sizes: tuple[int, ...]
    pool_blocks: tuple[int, ...]  # per KV group, the whole pool
    capture_sizes: tuple[int, ...]
    token_capture_sizes: tuple[int, ...]
    max_message_bytes: int
    mtp_layer_schedule: str = ""  # MTP methods: which layer each draft step runs (EngineConfig)
    predraft_tokens: int = 0  # k' where pre-drafts are deeper than k (a hit's row verifies k' drafts), else 0

    @property
    def verify_width(self) -> int:
        """The most drafts one row of a call may report verified: k, or k' after a deeper pre-draft's hit."""
        return max(self.num_drafts, self.predraft_tokens)

    @property
    def num_drafts(self) -> int:  # columns of draft_token_ids
        return len(self.speculative_token_tree) if self.speculative_token_tree else self.num_speculative_tokens


@dataclass
class Session:
    id: str
    client_name: str
    bases: tuple[int, ...]  # per KV group: first block of this session in the engine pool
    num_blocks: tuple[int, ...]  # per KV group
    block_sizes: tuple[int, ...]
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    hidden_dtype: torch.dtype
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    alive: bool = True
    calls: int = 0
    owner: str = ""  # the authenticated peer that attached it (mTLS CN, CURVE key); "" = none
    client: str = ""  # whose quota it counts against: Caller.client of the attach (the owner, else the connection)


@dataclass(frozen=True)
class ClientQuotas:
    """What one client (Caller.client: the authenticated peer, else the connection) may hold; 0 = no limit."""

    max_sessions: int = 0  # attached sessions
    max_kv_blocks: tuple[int, ...] = ()  # KV blocks over its sessions: one value for every group, or one per group
    max_inflight: int = 0  # calls queued or running (ServiceCore.begin)
    # a re-attach (same authenticated peer and client_name) replaces the old session once it has seen no
    # call for this long: a live sibling sharing the name and certificate keeps its session (0: at once)
    replace_idle_s: float = 30.0

    def kv_blocks_per_group(self, groups: int) -> tuple[int, ...]:
        """The block quota of each KV group (0 = none)."""
        if not self.max_kv_blocks:
            return (0,) * groups
        if len(self.max_kv_blocks) == 1:
            return self.max_kv_blocks * groups
        if len(self.max_kv_blocks) != groups:
            raise ValueError(f"--max-kv-blocks-per-client: {len(self.max_kv_blocks)} values for a head with "
                             f"{groups} KV groups")
        return self.max_kv_blocks


class BlockAllocator:
    """First-fit over free ranges of one group's pool; a session's range stays contiguous."""

    def __init__(self, total: int):
        self.total = total
        self.free: list[tuple[int, int]] = [(0, total)]  # (start, length), sorted, coalesced

    def allocate(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                self.free[i:i + 1] = [(start + n, length - n)] if length > n else []
                return start
        return None

    def release(self, start: int, n: int) -> None:
        ranges = sorted(self.free + [(start, n)])
        merged: list[tuple[int, int]] = []
        for s, l in ranges:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + l)
            else:
                merged.append((s, l))
        self.free = merged

    @property
    def free_blocks(self) -> int:
        return sum(l for _, l in self.free)


@dataclass(frozen=True)
class Mismatch:
    """One way an attaching target differs from what this drafter serves."""

    field: str  # the AttachRequest field, e.g. "kv_groups[0].block_size"
    code: Code
    problem: str  # "the target has 4096, this drafter serves 2048"
    fix: str = ""  # the `drafter serve` flag (with the value) that makes the drafter fit; "" when none does

    def detail(self) -> str:
        return self.problem + (f" (set drafter serve {self.fix})" if self.fix else "")

    def text(self) -> str:
        return f"{self.field}: {self.detail()}"


def refusal(found: list[Mismatch]) -> DrafterError:
    """All mismatches in one error: the operator fixes the drafter's flags once, not one restart per field.
    One mismatch keeps its own code and field; several are FAILED_PRECONDITION with the fields joined by ','."""
    if len(found) == 1:
        one = found[0]
        return DrafterError(one.code, one.field, one.detail())
    return DrafterError(Code.FAILED_PRECONDITION, ",".join(m.field for m in found),
                        f"{len(found)} mismatches: " + "; ".join(m.text() for m in found))


def _differs(name: str, got, want, fix: str = "") -> Mismatch:
    return Mismatch(name, Code.FAILED_PRECONDITION, f"the target has {got}, this drafter serves {want}", fix)


def _per_group_flag(flag: str, values: tuple[int, ...], g: int, needed: int) -> str:
    """`--kv-blocks 16384` (one group) or `--kv-blocks 16384,60` (the others as they are)."""
    out = list(values)
    out[g] = needed
    return f"{flag} {','.join(str(v) for v in out)}"


def layout_mismatches(req: schema.AttachRequest, eng: EngineDescription) -> list[Mismatch]:
    """Every way the target's layout differs from what this drafter can serve (empty: it can)."""
    found: list[Mismatch] = []
    if req.protocol_version != PROTOCOL_VERSION:
        # nothing else can be read reliably from a request of another protocol
        return [_differs("protocol_version", req.protocol_version, PROTOCOL_VERSION)]
    if req.method != eng.method:
        found.append(_differs("method", repr(req.method), repr(eng.method), f"--method {req.method}"))
    if req.mtp_layer_schedule and req.mtp_layer_schedule != eng.mtp_layer_schedule:
        found.append(_differs("mtp_layer_schedule", repr(req.mtp_layer_schedule), repr(eng.mtp_layer_schedule),
                              f"--mtp-layer-schedule {req.mtp_layer_schedule}"))
    tree = tuple(tuple(p.ranks) for p in req.speculative_token_tree) or None
    if tree != eng.speculative_token_tree:
        fix = f"--speculative-token-tree '{[list(p) for p in tree]}'" if tree else "--speculative-token-tree ''"
        found.append(_differs("speculative_token_tree", tree, eng.speculative_token_tree, fix))
    # A smaller k would still make the engine write k - 1 lookahead slots the target never allocated.
    if tree is None and req.num_speculative_tokens != eng.num_speculative_tokens:
        found.append(_differs("num_speculative_tokens", req.num_speculative_tokens, eng.num_speculative_tokens,
                              f"--num-speculative-tokens {req.num_speculative_tokens}"))
    if req.hidden_dtype not in DTYPES or not DTYPES[req.hidden_dtype].is_floating_point:
        found.append(Mismatch("hidden_dtype", Code.INVALID_ARGUMENT,
                              f"{req.hidden_dtype!r} is not one of float32, float16, bfloat16"))
    # the head's own width and inputs: serve the head (and target) the target drafts with
    head_fix = "--model / --target-model: the head and target vLLM was given"
    if req.hidden_size != eng.hidden_size:
        found.append(_differs("hidden_size", req.hidden_size, eng.hidden_size, head_fix))
    if req.num_aux_layers != eng.num_aux_layers:
        found.append(_differs("num_aux_layers", req.num_aux_layers, eng.num_aux_layers, head_fix))
    # Draft steps past max_model_len are clamped by the engine's limit: the target's must be the same.
    if req.max_model_len != eng.max_model_len:
        found.append(_differs("max_model_len", req.max_model_len, eng.max_model_len,
                              f"--max-model-len {req.max_model_len}"))
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        got, most = getattr(req, name), getattr(eng, name)
        if got == 0:
            found.append(Mismatch(name, Code.INVALID_ARGUMENT, "must be positive"))
        elif got > most:
            flag = "--" + name.replace("_", "-")
            found.append(Mismatch(name, Code.FAILED_PRECONDITION, f"the target has {got}, more than this "
                                  f"drafter's {most}", f"{flag} {got}"))
    if len(req.kv_groups) != len(eng.block_sizes):
        found.append(_differs("kv_groups", f"{len(req.kv_groups)} KV groups", len(eng.block_sizes),
                              f"--block-sizes {','.join(str(g.block_size) for g in req.kv_groups)} "
                              f"--kv-blocks {','.join(str(g.num_blocks) for g in req.kv_groups)}"))
        return found
    for g, (group, bs, pool) in enumerate(zip(req.kv_groups, eng.block_sizes, eng.pool_blocks)):
        if group.block_size != bs:
            found.append(_differs(f"kv_groups[{g}].block_size", group.block_size, bs,
                                  _per_group_flag("--block-sizes", eng.block_sizes, g, group.block_size)))
        if group.num_blocks == 0:
            found.append(Mismatch(f"kv_groups[{g}].num_blocks", Code.INVALID_ARGUMENT, "must be positive"))
        elif group.num_blocks > pool:
            # the drafter's pool mirrors the target's block ids: it must hold all of them
            found.append(Mismatch(f"kv_groups[{g}].num_blocks", Code.RESOURCE_EXHAUSTED,
                                  f"the target has {group.num_blocks} blocks, more than this drafter's whole "
                                  f"pool of {pool}", _per_group_flag("--kv-blocks", eng.pool_blocks, g,
                                                                      group.num_blocks)))
    return found


def check_layout(req: schema.AttachRequest, eng: EngineDescription) -> None:
    """Refuse a target whose layout this drafter cannot serve (before any block is reserved), naming
    every mismatch at once."""
    found = layout_mismatches(req, eng)
    if found:
        raise refusal(found)


def attach_requirements(cfg) -> str:
    """What a vLLM engine attaching to a drafter started with these flags (a ServerConfig) must match,
    in vLLM's terms; read from the flags alone (no head is loaded)."""
    rows = [
        ("speculative method", cfg.method, "--speculative-config method, exactly"),
        ("speculative tokens", cfg.speculative_token_tree or cfg.num_speculative_tokens,
         "--speculative-config " + ("speculative_token_tree" if cfg.speculative_token_tree else
                                    "num_speculative_tokens") + ", exactly"),
        ("max model len", cfg.max_model_len, "--max-model-len, exactly"),
        ("KV block size", cfg.block_sizes, "--block-size, exactly (per KV group)"),
        ("KV blocks", f"<= {cfg.kv_blocks}", "vLLM's KV block count in blocks (the plugin logs it); the sum "
                                             "over every engine attached at once"),
        ("max num seqs", f"<= {cfg.max_num_seqs}", "--max-num-seqs"),
        ("max num batched tokens", f"<= {cfg.max_num_batched_tokens}", "--max-num-batched-tokens"),
        ("padded drafter batch", cfg.padded_drafter_batch, "speculative_config disable_padded_drafter_batch "
                                                           "= the opposite (Model Runner V2: always padded)"),
        ("hidden size, aux layers", "those of --target-model / --model", "the target and head vLLM is given"),
    ]
    width = max(len(name) for name, _, _ in rows)
    lines = ["A vLLM engine attaching to this drafter must have (vLLM option in brackets):"]
    lines += [f"  {name:<{width}}  {value}  [{where}]" for name, value, where in rows]
    return "\n".join(lines)


_UNKNOWN_SESSION = "unknown session: attach first (or again)"


class SessionTable:
    def __init__(self, eng: EngineDescription, max_sessions: int, quotas: ClientQuotas = ClientQuotas()):
        self.eng = eng
        self.max_sessions = max_sessions
        self.quotas = quotas
        self.block_quotas = quotas.kv_blocks_per_group(len(eng.pool_blocks))
        self.allocators = [BlockAllocator(n) for n in eng.pool_blocks]
        self.sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self.sessions)

    def replaceable(self, req: schema.AttachRequest, caller: Caller, now: float | None = None) -> Session | None:
        """The session this attach replaces: one the same authenticated peer attached under the same
        non-empty client_name and that has seen no call for ClientQuotas.replace_idle_s, when the
        request's layout is one this drafter serves (else it is refused and the old session stays).  A
        target that restarts after dying without Detach so gets its blocks back at once, instead of after
        the idle timeout, while replicas that share a certificate and a name (vLLM names a session by
        model and DP rank) do not take each other's sessions in use.  Without auth nothing is replaced:
        a restarted target comes on a new connection, and one connection may carry several clients'
        sessions (gRPC channels of one process may share it)."""
        check_layout(req, self.eng)
        name = req.client_name[:128]
        if not name or not caller.peer:
            return None
        now = time.monotonic() if now is None else now
        quiet = self.quotas.replace_idle_s
        return next((s for s in self.sessions.values() if s.owner == caller.peer and s.client_name == name
                     and now - s.last_used >= quiet), None)

    def attach(self, req: schema.AttachRequest, caller: Caller | None = None) -> Session:
        """caller: who attaches.  Its authenticated peer (if any) alone may drive or detach the session; its
        client identity (Caller.client) is what the per-client quotas count."""
        caller = caller or Caller()
        check_layout(req, self.eng)
        if len(self.sessions) >= self.max_sessions:
            raise DrafterError(Code.RESOURCE_EXHAUSTED, "session", f"{self.max_sessions} sessions already attached")
        self._check_quotas(req, caller.client)
        bases: list[int] = []
        for g, group in enumerate(req.kv_groups):
            base = self.allocators[g].allocate(group.num_blocks)
            if base is None:
                for done, b in enumerate(bases):
                    self.allocators[done].release(b, req.kv_groups[done].num_blocks)
                raise DrafterError(
                    Code.RESOURCE_EXHAUSTED, f"kv_groups[{g}].num_blocks",
                    f"{group.num_blocks} blocks do not fit: {self.allocators[g].free_blocks} of "
                    f"{self.allocators[g].total} free, largest range {max((l for _, l in self.allocators[g].free), default=0)}")
            bases.append(base)
        s = Session(
            id=secrets.token_hex(16), client_name=req.client_name[:128], bases=tuple(bases),
            num_blocks=tuple(g.num_blocks for g in req.kv_groups), block_sizes=self.eng.block_sizes,
            max_model_len=req.max_model_len, max_num_seqs=req.max_num_seqs,
            max_num_batched_tokens=req.max_num_batched_tokens, hidden_dtype=DTYPES[req.hidden_dtype],
            owner=caller.peer, client=caller.client)
        self.sessions[s.id] = s
        return s

    def _check_quotas(self, req: schema.AttachRequest, client: str) -> None:
        """The client's session and KV-block quotas (RESOURCE_EXHAUSTED naming the flag)."""
        if not client:
            return
        mine = [s for s in self.sessions.values() if s.client == client]
        most = self.quotas.max_sessions
        if most and len(mine) >= most:
            raise DrafterError(Code.RESOURCE_EXHAUSTED, "session",
                               f"this client already holds {len(mine)} sessions (--max-sessions-per-client {most})")
        for g, (group, quota) in enumerate(zip(req.kv_groups, self.block_quotas)):
            held = sum(s.num_blocks[g] for s in mine)
            if quota and held + group.num_blocks > quota:
                raise DrafterError(Code.RESOURCE_EXHAUSTED, f"kv_groups[{g}].num_blocks",
                                   f"this client holds {held} blocks of KV group {g}; {group.num_blocks} more exceed "
                                   f"--max-kv-blocks-per-client {quota}")

    def get(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise DrafterError(Code.NOT_FOUND, "session_id", _UNKNOWN_SESSION)
        return s

    def owned(self, session_id: str, peer: str) -> Session:
        """The session, for the peer that may drive or detach it.  A session attached by an authenticated
        peer does not exist for any other (NOT_FOUND, as an unknown id: nothing tells whether an id is live)."""
        s = self.get(session_id)
        if s.owner and s.owner != peer:
            raise DrafterError(Code.NOT_FOUND, "session_id", _UNKNOWN_SESSION)
        return s

    def detach(self, session_id: str, owner: str = "") -> Session:
        """Forget the session; its blocks stay reserved until release() (after they were zeroed).  A session
        attached by an authenticated peer is detached only by that peer (owned())."""
        s = self.owned(session_id, owner)
        del self.sessions[session_id]
        s.alive = False
        return s

    def release(self, s: Session) -> None:
        for g, (base, n) in enumerate(zip(s.bases, s.num_blocks)):
            self.allocators[g].release(base, n)

    def idle(self, now: float, idle_s: float) -> list[Session]:
        return [s for s in self.sessions.values() if now - s.last_used > idle_s]

    def free_blocks(self) -> list[int]:
        return [a.free_blocks for a in self.allocators]


def _range(name: str, t: torch.Tensor, low: int, high: int) -> None:
    # numpy on the (CPU, decoded-from-the-wire) tensor: a fraction of torch's per-op overhead
    a = t.numpy() if t.is_cpu and not t.requires_grad else t.detach().cpu().numpy()
    if out_of_range(a, low, high):
        raise invalid(name, f"values must lie in [{low}, {high}), got [{int(a.min())}, {int(a.max())}]")


def check_call(s: Session, call: ProposeRequest, eng: EngineDescription) -> None:
    """The session's own limits; the engine's full validation follows (drafter.engine.inputs.validate)."""
    inp = call.inputs
    b, n = call.batch_size, call.num_tokens
    if b == 0:
        raise invalid("next_token_ids", "batch is empty")
    if b > s.max_num_seqs:
        raise invalid("next_token_ids", f"batch of {b} exceeds the session's max_num_seqs {s.max_num_seqs}")
    if n > s.max_num_batched_tokens:
        raise invalid("target_token_ids",
                      f"{n} tokens exceed the session's max_num_batched_tokens {s.max_num_batched_tokens}")
    _check_hidden(s, call, eng)
    _range("target_positions", inp.target_positions, 0, s.max_model_len)
    _range("seq_lens", inp.seq_lens, 1, s.max_model_len + 1)
    groups = len(s.num_blocks)
    for name, tables in (("block_tables", inp.block_tables), ("slot_mappings", inp.slot_mappings)):
        if len(tables) != groups:
            raise invalid(name, f"expected one entry per KV group ({groups}), got {len(tables)}")
    for g in range(groups):
        _range(f"block_tables[{g}]", inp.block_tables[g], 0, s.num_blocks[g])
        _range(f"slot_mappings[{g}]", inp.slot_mappings[g], -1, s.num_blocks[g] * s.block_sizes[g])
    if call.accepted_counts is not None:
        if call.accepted_counts.shape[0] != b:
            raise invalid("accepted_counts", f"has {call.accepted_counts.shape[0]} rows, expected batch {b}")
        _range("accepted_counts", call.accepted_counts, -1, eng.verify_width + 1)
    if call.batch_padded and not b <= call.batch_padded <= eng.capture_sizes[-1]:
        raise invalid("batch_padded", f"{call.batch_padded} must lie in [batch={b}, {eng.capture_sizes[-1]}]")
    if call.tokens_padded and not n <= call.tokens_padded <= eng.token_capture_sizes[-1]:
        raise invalid("tokens_padded",
                      f"{call.tokens_padded} must lie in [num_tokens={n}, {eng.token_capture_sizes[-1]}]")
    if call.return_probs:
        if eng.speculative_token_tree:
            raise invalid("return_probs", "tree drafting returns no probabilities")
        if eng.method == "extract_hidden_states":
            raise invalid("return_probs", "extract_hidden_states returns no probabilities")
        size = b * eng.num_speculative_tokens * eng.vocab_size * 4 + PROBS_HEADROOM
        if size > eng.max_message_bytes:
            raise invalid("return_probs", f"probabilities of {b} x {eng.num_speculative_tokens} x "
                                          f"{eng.vocab_size} float32 exceed max_message_bytes "
                                          f"{eng.max_message_bytes}")


def _check_hidden(s: Session, call: ProposeRequest, eng: EngineDescription) -> None:
    """The hidden states' dtype; for a CUDA IPC reference also its shape, before anything opens it."""
    ref = call.hidden_ipc
    if ref is None:
        dtype = call.inputs.target_hidden_states.dtype
        if dtype != s.hidden_dtype:
            raise invalid("target_hidden_states", f"dtype {dtype}, the session attached with {s.hidden_dtype}")
        return
    if ref.dtype != s.hidden_dtype:
        raise invalid(f"{IPC_FIELD}.dtype", f"dtype {ref.dtype}, the session attached with {s.hidden_dtype}")
    if ref.shape != (call.num_tokens, eng.hidden_width):
        raise invalid(f"{IPC_FIELD}.shape", f"shape {list(ref.shape)}, expected [num_tokens={call.num_tokens}, "
                                            f"hidden_width={eng.hidden_width}]")


def offset_inputs(s: Session, inp: ProposeInputs) -> ProposeInputs:
    """The session's block ids and slots moved into its range of the engine pool (-1 stays -1), as int64.

    A group whose range starts at block 0 keeps the caller's tensors as they are (nothing moves;
    the engine takes int32 as well).  Otherwise numpy does the shift (CPU tensors, as decoded from
    the wire): a fraction of torch's per-op cost on these small arrays."""
    tables = [t if base == 0 else _shift(t, base) for t, base in zip(inp.block_tables, s.bases)]
    slots = [t if base == 0 else _shift(t, base * bs, keep_negative=True)
             for t, base, bs in zip(inp.slot_mappings, s.bases, s.block_sizes)]
    return replace(inp, block_tables=tables, slot_mappings=slots)


def _shift(t: torch.Tensor, offset: int, keep_negative: bool = False) -> torch.Tensor:
    if not t.is_cpu:
        t = t.to(torch.int64)
        return torch.where(t >= 0, t + offset, t) if keep_negative else t + offset
    a = t.numpy()
    shifted = a.astype(np.int64)  # a new array (also for int64): the request's own tensor stays as it was
    shifted += offset  # in place: cheaper than np.add(..., dtype=np.int64), which casts as it goes
    if keep_negative and a.size and a.item(a.argmin()) < 0:  # padding slots: only some calls have them
        np.copyto(shifted, a, where=a < 0)
    return torch.from_numpy(shifted)
