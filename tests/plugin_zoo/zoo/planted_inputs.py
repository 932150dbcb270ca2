"""Planted bugs that only the load check's inputs can reach (pytest_enginecheck/prompts.py): a position past 63, and a
decode step that opens a new KV block. Three prompts of 3, 8 and 17 tokens with 6 generated ones reach neither, so
both passed every oracle. Each is in layer 1 of a tiny Llama that declares transformers' LlamaForCausalLM its
reference, beside a clean twin with the same code shape and the right numbers.

``zoo.reference_registry:REGISTRY`` registers them (tests/pytest_enginecheck/test_input_coverage.py).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from engine_ref.config import HFConfig
from engine_ref.model_executor.forward_context import get_attn_metadata
from engine_ref.model_executor.layers.attention import Attention
from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig
from engine_ref.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope_parameters
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine_ref.utils import cdiv

REFERENCE = "LlamaForCausalLM"
ROTARY_TABLE = 64  # positions the planted rotary table holds


def _example(name: str) -> dict[str, Any]:
    return {**LlamaForCausalLM.example_config, "architectures": [name]}


class TableRotaryEmbedding(RotaryEmbedding):
    """A rotary embedding read from a table of ``table`` positions: a later position reads the table's last row."""

    def __init__(self, head_size: int, rope_parameters: dict[str, Any], table: int) -> None:
        super().__init__(head_size, rope_parameters)
        self.table = table

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(positions.clamp(max=self.table - 1), q, k)


class DecodePathAttention(Attention):
    """Attention with a decode path of its own (every sequence one new token): it gathers the blocks that hold
    ``cdiv(context, block_size)`` tokens from the cache, then the first ``seq_len`` keys and values of them."""

    def __init__(self, attn: Attention, context_offset: int) -> None:
        super().__init__(attn.num_heads, attn.head_size, attn.scale, attn.num_kv_heads)
        self.context_offset = context_offset  # tokens of seq_len the gathered blocks are counted without

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = get_attn_metadata()
        starts = md.query_start_loc
        decode = all(b - a == 1 for a, b in zip(starts, starts[1:]))
        if not decode or self.kv_cache is None or md.slot_mapping is None or md.block_tables is None:
            return super().forward(q, k, v)
        q = q.view(-1, self.num_heads, self.head_size)
        self._write_cache(self.kv_cache, md.slot_mapping, k.view(-1, self.num_kv_heads, self.head_size),
                          v.view(-1, self.num_kv_heads, self.head_size))
        block_size = self.kv_cache.shape[2]
        outputs = []
        for i, (table, seq_len) in enumerate(zip(md.block_tables, md.seq_lens, strict=True)):
            blocks = table[:cdiv(seq_len - self.context_offset, block_size)]
            keys = self.kv_cache[0][blocks].flatten(0, 1)[:seq_len]
            values = self.kv_cache[1][blocks].flatten(0, 1)[:seq_len]
            outputs.append(self._attend(q[i:i + 1], keys, values))
        return torch.cat(outputs).view(-1, self.num_heads * self.head_size)


class _InputsDecoderLayer(LlamaDecoderLayer):
    table: ClassVar[int | None] = None  # layer 1's rotary table (None: the shared rotary embedding)
    context_offset: ClassVar[int | None] = None  # layer 1's decode path (None: the shared attention)

    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        attn = self.self_attn
        if layer_idx == 1 and self.table is not None:
            attn.rotary_emb = TableRotaryEmbedding(attn.head_dim, get_rope_parameters(config), self.table)
        if layer_idx == 1 and self.context_offset is not None:
            attn.attn = DecodePathAttention(attn.attn, self.context_offset)


class _InputsLlama(LlamaForCausalLM):
    enginecheck_reference: ClassVar[str] = REFERENCE


# 1. Layer 1's rotary table holds 64 positions (sized by the wrong field): positions past 63 rotate as 63.
class ClampedRopeDecoderLayer(_InputsDecoderLayer):
    table = ROTARY_TABLE


class ClampedRopeLlamaForCausalLM(_InputsLlama):
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = ClampedRopeDecoderLayer
    example_config: ClassVar[dict] = _example("ClampedRopeLlamaForCausalLM")


# 2. Layer 1's decode path counts the blocks to gather from the context before this step's token (seq_len - 1): a
# token that opens a new block attends without its own key and value. Prefill, and decode inside a block, are right.
class DecodeBlockDecoderLayer(_InputsDecoderLayer):
    context_offset = 1


class DecodeBlockLlamaForCausalLM(_InputsLlama):
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = DecodeBlockDecoderLayer
    example_config: ClassVar[dict] = _example("DecodeBlockLlamaForCausalLM")


# The clean twin of both: a rotary table as long as max_position_embeddings, a decode path that counts every token.
class CleanInputsDecoderLayer(_InputsDecoderLayer):
    table = LlamaForCausalLM.example_config["max_position_embeddings"]
    context_offset = 0


class CleanInputsLlamaForCausalLM(_InputsLlama):
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = CleanInputsDecoderLayer
    example_config: ClassVar[dict] = _example("CleanInputsLlamaForCausalLM")
