"""KV cache specs: the pages one rank's attention layers need per block.

One block holds ``block_size`` tokens of keys and values for one layer:
    page_size_bytes = 2 * block_size * num_kv_heads * head_size * dtype_bytes
A block id addresses that page in every layer, so one block costs the sum over layers
(``bytes_per_block``); ``sizing.py`` turns that into a number of blocks.
"""

from __future__ import annotations

from dataclasses import dataclass


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
