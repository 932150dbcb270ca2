"""Mixtral: Llama attention with a sparse mixture-of-experts MLP (``block_sparse_moe``)."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from engine_ref.config import HFConfig
from engine_ref.model_executor.layers.activation import check_gated_silu
from engine_ref.model_executor.layers.fused_moe import FusedMoE, SparseMoeBlock
from engine_ref.model_executor.model_loader.weight_utils import WeightsMapper
from engine_ref.model_executor.models.interfaces import MixtureOfExperts
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: HFConfig, layer_idx: int) -> nn.Module:
        check_gated_silu(config.get("hidden_act", "silu"))
        return SparseMoeBlock(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, renormalize=True, quant_config=self.quant_config,
                              prefix=f"{self.prefix}.mlp")


class MixtralForCausalLM(LlamaForCausalLM, MixtureOfExperts):
    """Equal to transformers' MixtralForCausalLM."""

    decoder_layer_cls = MixtralDecoderLayer
    reference_config: ClassVar[str] = "Mixtral-8x7B-v0.1.json"
    example_config: ClassVar[dict] = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "torch_dtype": "float32",
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }

    def make_weights_mapper(self, config: HFConfig) -> WeightsMapper:
        base = super().make_weights_mapper(config)
        experts = FusedMoE.make_expert_params_mapping("w1", "w2", "w3", config.num_local_experts)
        return WeightsMapper(mapping=(*experts, *base.mapping), renames=((".mlp.", ".block_sparse_moe."),),
                             skip=base.skip)
