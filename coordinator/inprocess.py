"""The in-process transport: the drafter engine in the target's own process, behind the same
attach / propose / detach shape as the network clients.

A target engine swaps this for the gRPC or ZMQ client without other changes.  Each session gets
its own DraftEngine (its own KV pool mirroring the target's block ids); the head's weights are
loaded once and shared.  `restart()` models a drafter restart (new epoch, sessions gone) and
`fail()` a dead one, so the client's fail-closed path can be tested without processes.
"""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

from drafter.engine.config import EngineConfig
from drafter.engine.engine import DraftEngine
from drafter.wire.errors import InvalidInput
from drafter.wire.records import DraftOutput, ProposeRequest
from drafter.models.loader import load_head

from coordinator.session import Code, DrafterError, SessionInfo, SessionSpec


class InProcessTransport:
    name = "inprocess"

    def __init__(self, head_dir: str | Path, target_dir: str | Path, method: str, *, device: str = "cpu",
                 max_sessions: int = 16, seed: int = 0):
        self.head_dir, self.target_dir, self.method = str(head_dir), str(target_dir), method
        self.device = device
        self.max_sessions = max_sessions
        self.seed = seed
        self.head = load_head(head_dir, method, target_dir, device=device)
        self.sessions: dict[str, DraftEngine] = {}
        self._ids = itertools.count()
        self.epoch = uuid.uuid4().hex[:12]
        self.down: Code | None = None  # an error code every call answers while set

    # ---------------------------------------------------------------- chaos controls (tests)
    def restart(self) -> None:
        self.sessions.clear()
        self.epoch = uuid.uuid4().hex[:12]
        self.down = None

    def fail(self, code: Code = Code.UNAVAILABLE) -> None:
        self.down = code

    # ---------------------------------------------------------------- transport
    def _check_up(self) -> None:
        if self.down:
            raise DrafterError(self.down, "", "drafter is down")

    def attach(self, spec: SessionSpec, timeout: float) -> SessionInfo:
        self._check_up()
        if spec.method != self.method:
            raise DrafterError(Code.INVALID_ARGUMENT, "method", f"this drafter serves {self.method}, not {spec.method}")
        if len(self.sessions) >= self.max_sessions:
            raise DrafterError(Code.RESOURCE_EXHAUSTED, "", f"{self.max_sessions} sessions attached")
        try:
            config = EngineConfig(
                method=spec.method, num_speculative_tokens=spec.num_speculative_tokens,
                max_model_len=spec.max_model_len, max_num_seqs=spec.max_num_seqs,
                max_num_batched_tokens=spec.max_num_batched_tokens, kv_groups=spec.kv_groups, dtype=spec.dtype,
                mtp_layer_schedule=spec.mtp_layer_schedule, device=self.device, seed=self.seed)
            engine = DraftEngine(self.head, self.head.spec, config)
        except ValueError as e:
            raise DrafterError(Code.INVALID_ARGUMENT, "session", str(e)) from e
        if engine.spec.hidden_input_width != spec.hidden_width:
            raise DrafterError(Code.INVALID_ARGUMENT, "hidden_size",
                               f"head takes width {engine.spec.hidden_input_width}, session sends {spec.hidden_width}")
        sid = f"s{next(self._ids)}"
        self.sessions[sid] = engine
        return SessionInfo(sid, self.epoch, config.capture_sizes, config.token_capture_sizes, config.max_num_seqs,
                           config.max_num_batched_tokens)

    def _engine(self, session: SessionInfo) -> DraftEngine:
        self._check_up()
        if session.epoch != self.epoch:
            raise DrafterError(Code.FAILED_PRECONDITION, "epoch",
                               f"session from epoch {session.epoch}, now {self.epoch}")
        engine = self.sessions.get(session.session_id)
        if engine is None:
            raise DrafterError(Code.NOT_FOUND, "session_id", f"unknown session {session.session_id}")
        return engine

    def request_drafts(self, session: SessionInfo, request: ProposeRequest, timeout: float) -> DraftOutput:
        engine = self._engine(session)  # accepted_counts feeds a server's metrics; the engine has none
        try:
            return engine.draft(request.inputs, return_probs=request.return_probs,
                                batch_padded=request.batch_padded or None, tokens_padded=request.tokens_padded or None)
        except InvalidInput as e:
            raise DrafterError(Code.INVALID_ARGUMENT, e.field, str(e)) from e

    def detach(self, session: SessionInfo, timeout: float) -> None:
        self._check_up()
        self.sessions.pop(session.session_id, None)

    def close(self) -> None:
        pass
