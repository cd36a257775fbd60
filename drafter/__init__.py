"""drafter: a disaggregated speculative-decoding drafter.

Data flows  checkpoint dir -> models/ (draft heads) -> engine (paged KV groups,
static buffers, proposer) -> servers (gRPC / ZMQ) -> coordinator (target side).
"""

from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.engine.engine import DraftEngine
from drafter.wire.records import DraftOutput

__all__ = ["DraftEngine", "DraftOutput", "EngineConfig", "KVGroupSpec"]
