"""Llama variants whose tensor parallelism is wrong in the three ways the load check's diagnosis tells apart."""

from __future__ import annotations

from typing import ClassVar

from engine_ref.config import HFConfig
from engine_ref.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def _o_proj_input(config: HFConfig) -> int:
    heads = config.num_attention_heads
    return heads * (config.get("head_dim") or config.hidden_size // heads)


class RowAsColumnDecoderLayer(LlamaDecoderLayer):
    """The bug: o_proj, whose input is this rank's attention heads, declared column-parallel."""

    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        self.self_attn.o_proj = ColumnParallelLinear(_o_proj_input(config), config.hidden_size, bias=False,
                                                     prefix=f"{prefix}.self_attn.o_proj")


class RowAsColumnLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = RowAsColumnDecoderLayer
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["RowAsColumnLlamaForCausalLM"]}


class NoAllReduceDecoderLayer(LlamaDecoderLayer):
    """The bug: o_proj is row-parallel, but never sums its ranks' partial outputs (no all-reduce)."""

    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        self.self_attn.o_proj = RowParallelLinear(_o_proj_input(config), config.hidden_size, bias=False,
                                                  reduce_results=False, prefix=f"{prefix}.self_attn.o_proj")


class NoAllReduceLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = NoAllReduceDecoderLayer
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["NoAllReduceLlamaForCausalLM"]}
