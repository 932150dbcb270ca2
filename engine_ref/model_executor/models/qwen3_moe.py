"""Qwen3-MoE: attention with per-head q/k RMSNorm and no biases; MoE MLPs (some layers dense)."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from engine_ref.config import HFConfig
from engine_ref.model_executor.layers.activation import check_gated_silu
from engine_ref.model_executor.layers.fused_moe import FusedMoE, SparseMoeBlock
from engine_ref.model_executor.model_loader.weight_utils import WeightsMapper
from engine_ref.model_executor.models.interfaces import MixtureOfExperts
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


def is_moe_layer(config: HFConfig, layer_idx: int) -> bool:
    return (layer_idx not in config.get("mlp_only_layers", [])
            and config.num_experts > 0
            and (layer_idx + 1) % config.get("decoder_sparse_step", 1) == 0)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    qkv_bias = False
    o_bias = False
    qk_norm = True

    def make_mlp(self, config: HFConfig, layer_idx: int) -> nn.Module:
        if not is_moe_layer(config, layer_idx):
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu"),
                            quant_config=self.quant_config, prefix=f"{self.prefix}.mlp")
        check_gated_silu(config.get("hidden_act", "silu"))
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, renormalize=bool(config.get("norm_topk_prob", True)),
                              quant_config=self.quant_config, prefix=f"{self.prefix}.mlp")


class Qwen3MoeForCausalLM(LlamaForCausalLM, MixtureOfExperts):
    """Equal to transformers' Qwen3MoeForCausalLM."""

    decoder_layer_cls = Qwen3MoeDecoderLayer
    reference_config: ClassVar[str] = "Qwen3-30B-A3B.json"
    example_config: ClassVar[dict] = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "float32",
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 512, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    }

    def make_weights_mapper(self, config: HFConfig) -> WeightsMapper:
        base = super().make_weights_mapper(config)
        experts = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", config.num_experts)
        return WeightsMapper(mapping=(*experts, *base.mapping), skip=base.skip)
