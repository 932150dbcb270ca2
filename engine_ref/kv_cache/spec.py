"""KV cache specs and sizing: how many blocks fit, and a clear error when a request cannot.

One block holds ``block_size`` tokens of keys and values for one layer:
    page_size_bytes = 2 * block_size * num_kv_heads * head_size * dtype_bytes
A block id addresses that page in every layer, so
    num_blocks = available_bytes // sum(page_size_bytes over layers)
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_ref.errors import KVCacheTooSmallError
from engine_ref.utils import cdiv, format_bytes


@dataclass(frozen=True)
class FullAttentionSpec:
    """The KV cache of one full-attention layer on one rank."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes


def bytes_per_block(specs: dict[str, FullAttentionSpec]) -> int:
    """Bytes one block id costs, summed over every layer."""
    return sum(spec.page_size_bytes for spec in specs.values())


def get_num_blocks(specs: dict[str, FullAttentionSpec], available_bytes: int) -> int:
    """How many blocks fit in ``available_bytes`` (never negative)."""
    return max(0, available_bytes) // bytes_per_block(specs)


def check_enough_kv_cache_memory(specs: dict[str, FullAttentionSpec], num_blocks: int, block_size: int,
                                 max_model_len: int, available_bytes: int) -> None:
    """Raise KVCacheTooSmallError unless one request of ``max_model_len`` tokens fits in ``num_blocks``."""
    if num_blocks * block_size >= max_model_len:
        return
    per_block = bytes_per_block(specs)
    needed = cdiv(max_model_len, block_size) * per_block
    largest = num_blocks * block_size
    raise KVCacheTooSmallError(
        f"To serve at least one request with max_model_len {max_model_len}, {format_bytes(needed)} of KV "
        f"cache is needed, larger than the available {format_bytes(max(0, available_bytes))} "
        f"({num_blocks} blocks of {block_size} tokens); the largest max_model_len that fits is {largest}. "
        f"Raise gpu_memory_utilization or the device memory, lower max_model_len (to at most {largest}), "
        f"or raise tensor_parallel_size."
    )
