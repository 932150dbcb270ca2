"""Planted bugs that every self-consistency oracle passes (the same at every TP size, seed and KV-cache use), each in
layer 1 or later of a tiny Llama that declares transformers' LlamaForCausalLM its reference
(``enginecheck_reference``): load[tp=1]'s reference oracle must catch each, naming where it is. Beside them, the
clean twins: the plain subclass, a subclass that computes something else on purpose and declares its own reference
(a transformers class of the author's), and a subclass with no reference (held to self-consistency, said so).

``zoo.reference_registry:REGISTRY`` registers them (tests/pytest_enginecheck/test_reference_oracle.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import transformers
from torch import nn

from engine_ref.config import HFConfig
from engine_ref.model_executor.layers.activation import SiluAndMul
from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig
from engine_ref.model_executor.layers.rotary_embedding import get_rope
from engine_ref.model_executor.model_loader.weight_utils import CheckpointTensor, WeightsMapper
from engine_ref.model_executor.models.llama import STACKED_PARAMS_MAPPING, LlamaDecoderLayer, LlamaForCausalLM

REFERENCE = "LlamaForCausalLM"  # transformers' class each planted model says it computes


def _example(name: str, **changes: Any) -> dict[str, Any]:
    return {**LlamaForCausalLM.example_config, "architectures": [name], **changes}


class _RefLlama(LlamaForCausalLM):
    enginecheck_reference: ClassVar[str] = REFERENCE


class CleanRefLlamaForCausalLM(_RefLlama):
    """Clean twin: a plain subclass, held to transformers' Llama (passes)."""

    example_config: ClassVar[dict] = _example("CleanRefLlamaForCausalLM", rope_theta=500000.0)


# 1. A name-mapping bug in load_weights: layers 1 and 2 get each other's weights (three layers here).
class SwapLayersRefLlamaForCausalLM(_RefLlama):
    example_config: ClassVar[dict] = _example("SwapLayersRefLlamaForCausalLM", num_hidden_layers=3)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        swap = {"layers.1.": "layers.2.", "layers.2.": "layers.1."}

        def renamed(name: str) -> str:
            return next((name.replace(a, b) for a, b in swap.items() if a in name), name)

        loaded = super().load_weights((renamed(name), tensor) for name, tensor in weights)
        return {renamed(name) for name in loaded}


# 2. Layer 1 reads the rope theta from a field the config does not have, so it gets the default (10000, not 500000).
class RopeDefaultDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        if layer_idx == 1:
            wrong = HFConfig({k: v for k, v in config.items() if k != "rope_theta"})
            wrong["rope_theta"] = config.get("rope_base", 10000.0)
            self.self_attn.rotary_emb = get_rope(self.self_attn.head_dim, wrong)


class RopeDefaultRefLlamaForCausalLM(_RefLlama):
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = RopeDefaultDecoderLayer
    example_config: ClassVar[dict] = _example("RopeDefaultRefLlamaForCausalLM", rope_theta=500000.0)


# 3. lm_head tied to the embedding although config.json says untied: the checkpoint's lm_head.weight is skipped.
class TiedHeadRefLlamaForCausalLM(_RefLlama):
    example_config: ClassVar[dict] = _example("TiedHeadRefLlamaForCausalLM")

    def __init__(self, config: HFConfig, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, quant_config)
        self.lm_head = self.model.embed_tokens

    def make_weights_mapper(self, config: HFConfig) -> WeightsMapper:
        return WeightsMapper(mapping=STACKED_PARAMS_MAPPING, skip=("rotary_emb.inv_freq", "lm_head."))


# 4. A parameter overwritten after loading: layer 1's post-attention norm weight reset to ones.
class OverwrittenNormRefLlamaForCausalLM(_RefLlama):
    example_config: ClassVar[dict] = _example("OverwrittenNormRefLlamaForCausalLM")

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        with torch.no_grad():
            self.model.layers[1].post_attention_layernorm.weight.fill_(1.0)
        return loaded


class GeluAndMul(SiluAndMul):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.gelu(gate) * up


# 5. GELU in place of SiLU in layer 1's MLP.
class GeluDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: HFConfig, layer_idx: int) -> nn.Module:
        mlp = super().make_mlp(config, layer_idx)
        if layer_idx == 1:
            mlp.act_fn = GeluAndMul()
        return mlp


class GeluRefLlamaForCausalLM(_RefLlama):
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = GeluDecoderLayer
    example_config: ClassVar[dict] = _example("GeluRefLlamaForCausalLM")


# A subclass that computes something else on purpose (its embeddings scaled by sqrt(hidden_size), as Gemma does) and
# declares the transformers class of its author's that computes the same: a clean twin. Its sibling declares
# transformers' plain Llama instead, which it is not: the oracle holds each to what it declares.
class ScaledEmbedLlamaForCausalLM(LlamaForCausalLM):
    enginecheck_reference: ClassVar[str] = "zoo.planted_reference:HFScaledEmbedLlamaForCausalLM"
    example_config: ClassVar[dict] = _example("ScaledEmbedLlamaForCausalLM")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids) * math.sqrt(self.config.hidden_size)
        return self.model(input_ids, positions, inputs_embeds)


class HFScaledEmbedLlamaForCausalLM(transformers.LlamaForCausalLM):
    """The author's reference for ScaledEmbedLlamaForCausalLM, in transformers' terms."""

    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids) * math.sqrt(self.config.hidden_size)
        return super().forward(inputs_embeds=inputs_embeds, **kwargs)


class ScaledEmbedWrongRefLlamaForCausalLM(ScaledEmbedLlamaForCausalLM):
    enginecheck_reference: ClassVar[str] = REFERENCE
    example_config: ClassVar[dict] = _example("ScaledEmbedWrongRefLlamaForCausalLM")


class NoRefLlamaForCausalLM(LlamaForCausalLM):
    """No transformers class of its name and none declared: self-consistency only, and its result says so."""

    example_config: ClassVar[dict] = _example("NoRefLlamaForCausalLM")

