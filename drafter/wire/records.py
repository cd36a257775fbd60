"""The typed records of one propose call, the same from a target's client to the engine thread.

    ProposeInputs   the call's tensors (DraftEngine.propose's keywords), as the engine reads them
    ProposeRequest  ProposeInputs plus what the service adds: session, epoch, request id, the
                    acceptance report, agreed padded sizes, return_probs, and a CUDA IPC reference
                    that replaces the hidden states
    ProposeResult   one request's drafts on the server, before they are encoded
    DraftOutput     what the engine and every client return

The path of one call, a verb per layer:
    client   transport.request_drafts(request)     encodes it (tensors.py / pbwire.py)
    server   decode -> ServiceCore.serve_propose(request) -> Batcher.submit
    engine   EngineRunner.run_batch(pending) -> DraftEngine.draft(inputs) -> DraftOutput
DraftEngine.propose(**keywords) and the clients' propose(**keywords) are keyword front doors that
build these records once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch

from drafter.wire.cuda_ref import CudaIpcRef


@dataclass
class ProposeInputs:
    target_token_ids: torch.Tensor  # [num_tokens] int
    target_positions: torch.Tensor  # [num_tokens] int
    # [num_tokens, hidden_input_width] float; None only while a request's CUDA IPC reference stands
    # in for it (the engine thread opens the reference and puts the tensor here)
    target_hidden_states: torch.Tensor | None
    next_token_ids: torch.Tensor  # [batch] int
    query_start_loc: torch.Tensor  # [batch + 1] int
    seq_lens: torch.Tensor  # [batch] int, includes this step's tokens (and rejected ones, padded path)
    block_tables: list[torch.Tensor]  # per KV group: [batch, max_blocks] int
    slot_mappings: list[torch.Tensor]  # per KV group: [num_tokens] int, -1 = write nothing
    token_indices_to_sample: torch.Tensor | None = None  # [batch] int
    num_rejected_tokens: torch.Tensor | None = None  # [batch] int
    temperatures: torch.Tensor | None = None  # [batch] float, 0 = greedy

    @property
    def num_tokens(self) -> int:
        return self.target_token_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return self.next_token_ids.shape[0]


INPUT_FIELDS = tuple(f.name for f in fields(ProposeInputs))
# what a propose call may say besides its tensors (the clients' keyword front door)
OPTIONS = ("accepted_counts", "return_probs", "batch_padded", "tokens_padded", "request_id")


class Caller(NamedTuple):
    """Who sent a call, as the receiving transport identifies them (filled in on the server).  A
    NamedTuple: immutable, and built per message for a fraction of a frozen dataclass's cost."""

    peer: str = ""  # the authenticated identity ("x509:<CN>", "curve:<key>"); "" when unauthenticated
    connection: str = ""  # the connection it came on (a ZMQ routing id, a gRPC peer address)

    @property
    def client(self) -> str:
        """The identity quotas and fairness count by: the authenticated peer, else the connection."""
        return self.peer or self.connection


@dataclass
class ProposeRequest:
    """One propose call, independent of the transport it travels on."""

    inputs: ProposeInputs
    accepted_counts: torch.Tensor | None = None  # [batch] int, -1 = no report for that row
    return_probs: bool = False
    batch_padded: int = 0  # 0 = the server chooses
    tokens_padded: int = 0
    # target_hidden_states in the target's GPU memory instead of inputs.target_hidden_states
    hidden_ipc: CudaIpcRef | None = None
    session_id: str = ""  # the client fills these three in
    epoch: int = 0
    request_id: int = 0
    deadline: float | None = None  # time.monotonic() after which the result is useless (server)
    probe: object = None  # drafter.wire.probes.Probe when stage timing is on
    caller: Caller | None = None  # who sent it, as the server's transport tells (server; None: unknown)
    want_predrafts: bool = False  # ZMQ: push this call's pre-drafts after the reply (drafter.wire.predraft)

    @property
    def batch_size(self) -> int:
        return self.inputs.next_token_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.inputs.target_token_ids.shape[0]

    @classmethod
    def from_keywords(cls, *, accepted_counts=None, return_probs: bool = False, batch_padded: int | None = None,
                      tokens_padded: int | None = None, request_id: int = 0, **tensors) -> "ProposeRequest":
        """DraftEngine.propose's tensor keywords (a bare tensor for a single KV group's block_tables /
        slot_mappings too) and the service's options -> the record; an unknown name fails here."""
        unknown = set(tensors) - set(INPUT_FIELDS)
        if unknown:
            raise TypeError(f"propose() got unexpected keyword arguments {sorted(unknown)}")
        for name in ("block_tables", "slot_mappings"):  # a missing one stays None: the drafter names it
            value = tensors.get(name)
            if value is not None:
                tensors[name] = [value] if isinstance(value, torch.Tensor) else list(value)
        inputs = ProposeInputs(**{n: tensors.get(n) for n in INPUT_FIELDS})
        return cls(inputs, accepted_counts, bool(return_probs), batch_padded or 0, tokens_padded or 0,
                   request_id=request_id or 0)


@dataclass
class ProposeResult:
    request_id: int
    draft_token_ids: torch.Tensor  # [batch, k] int64
    draft_probs: torch.Tensor | None  # [batch, k, vocab] float32
    batch_padded: int
    tokens_padded: int
    timings: dict = field(default_factory=dict)


@dataclass
class DraftOutput:
    draft_token_ids: torch.Tensor  # [batch, k] int64, or [batch, num_tree_nodes] for a tree
    draft_probs: torch.Tensor | None  # [batch, k, vocab] float32 when asked
    batch_padded: int  # rows the draft loop ran (capture size or the agreed DP size)
    tokens_padded: int  # rows the first pass ran
    draft_logits: torch.Tensor | None = None  # [batch, k, head_vocab] when asked (parity checks, debugging)
