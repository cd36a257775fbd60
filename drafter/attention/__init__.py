"""Attention backends over the paged KV cache."""

from drafter.attention.metadata import PADDING_SLOT_ID, AttentionMetadata
from drafter.attention.reference import ReferenceBackend

__all__ = ["PADDING_SLOT_ID", "AttentionMetadata", "ReferenceBackend"]
