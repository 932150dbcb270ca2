"""Paged attention in pure torch: readable, the same on CPU and CUDA.

The KV cache of a layer is one tensor ``[2, num_blocks, block_size, num_kv_heads, head_size]``
(keys, values). A token's slot is ``block * block_size + offset``; each sequence's block table
lists its blocks in order. A forward pass writes this step's keys and values into their slots,
then each sequence attends over its first ``seq_len`` cached tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from engine_ref.model_executor.forward_context import get_attn_metadata
from engine_ref.utils import cdiv


class Attention(nn.Module):
    """Causal multi-head attention with grouped KV heads over a paged KV cache."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None  # bound by the worker's initialize_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = get_attn_metadata()
        q = q.view(-1, self.num_heads, self.head_size)
        k = k.view(-1, self.num_kv_heads, self.head_size)
        v = v.view(-1, self.num_kv_heads, self.head_size)
        starts = md.query_start_loc
        kvs: Iterator[tuple[torch.Tensor, torch.Tensor]]
        if self.kv_cache is None or md.slot_mapping is None or md.block_tables is None:
            # the profile run: a prefill with no cache yet, each sequence attends over its own keys
            kvs = ((k[starts[i]:starts[i + 1]], v[starts[i]:starts[i + 1]]) for i in range(len(md.seq_lens)))
        else:
            self._write_cache(self.kv_cache, md.slot_mapping, k, v)
            kvs = self._read_cache(self.kv_cache, md.block_tables, md.seq_lens)
        outputs = [self._attend(q[starts[i]:starts[i + 1]], keys, values) for i, (keys, values) in enumerate(kvs)]
        return torch.cat(outputs).view(-1, self.num_heads * self.head_size)

    def _write_cache(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> None:
        """Write this step's keys and values into their slots."""
        kv_cache[0].view(-1, self.num_kv_heads, self.head_size).index_copy_(0, slot_mapping, k)
        kv_cache[1].view(-1, self.num_kv_heads, self.head_size).index_copy_(0, slot_mapping, v)

    def _read_cache(self, kv_cache: torch.Tensor, block_tables: list[list[int]], seq_lens: list[int]
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each sequence's first seq_len cached keys and values, gathered one sequence at a time."""
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        block_size = key_cache.shape[1]
        for table, seq_len in zip(block_tables, seq_lens, strict=True):
            blocks = table[: cdiv(seq_len, block_size)]
            yield key_cache[blocks].flatten(0, 1)[:seq_len], value_cache[blocks].flatten(0, 1)[:seq_len]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[q_len, heads, d]`` over k, v ``[k_len, kv_heads, d]``; the queries are the last q_len positions."""
        q_len, k_len = q.shape[0], k.shape[0]
        mask = None
        if 1 < q_len < k_len:
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, is_causal=q_len == k_len and q_len > 1, scale=self.scale, enable_gqa=True,
        )
        return out.transpose(0, 1)
