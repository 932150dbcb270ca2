"""The per-step state attention layers read during a forward pass (vLLM's forward context)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's tokens sit in the flattened batch and in the paged KV cache.

    Tokens of all sequences are concatenated; sequence i owns rows
    ``query_start_loc[i]:query_start_loc[i + 1]``, which are its last query tokens out of
    ``seq_lens[i]``. Without ``slot_mapping`` (the profile run) attention sees only this step's keys.
    """

    query_start_loc: list[int]
    seq_lens: list[int]
    slot_mapping: torch.Tensor | None = None
    block_tables: list[list[int]] | None = None


_attn_metadata: AttentionMetadata | None = None


def get_attn_metadata() -> AttentionMetadata:
    if _attn_metadata is None:
        raise RuntimeError("attention ran outside set_forward_context(); the model runner must set it")
    return _attn_metadata


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata) -> Iterator[None]:
    """Make ``attn_metadata`` visible to every Attention layer for one forward pass."""
    global _attn_metadata
    previous, _attn_metadata = _attn_metadata, attn_metadata
    try:
        yield
    finally:
        _attn_metadata = previous
