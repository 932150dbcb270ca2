"""Planted bugs in how a model accounts for its checkpoint (issue 31, item 5), each in layer 1 or in the LM head of a
tiny Llama, each the same at every seed, TP size and KV-cache use. None declares a reference implementation (their
names are no transformers class), so only the engine's loader (every checkpoint tensor consumed,
engine_ref/model_executor/model_loader/loaders.py) and load[tp=1]'s checkpoint oracle
(pytest_enginecheck/targets/engine_ref/checkpoint_values.py) stand between them and a green load. Beside them the
clean twins, also held to transformers' Llama: tied embeddings declared tied, a checkpoint tensor declared unused
(a parameter the model derives), a persistent buffer declared derived.

``zoo.reference_registry:REGISTRY`` registers them (tests/pytest_enginecheck/test_checkpoint_accounting.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar, cast

import torch
from torch import nn

from engine_ref.config import HFConfig
from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig
from engine_ref.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope_parameters
from engine_ref.model_executor.model_loader.weight_utils import CheckpointTensor, WeightsMapper
from engine_ref.model_executor.models.llama import (
    STACKED_PARAMS_MAPPING,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)

Weights = Iterable[tuple[str, CheckpointTensor]]


def _example(name: str, **changes: Any) -> dict[str, Any]:
    return {**LlamaForCausalLM.example_config, "architectures": [name], **changes}


# 1. The loader: load_weights hands layer 0's down_proj tensor to layer 1 too ("the layers share their MLP") and
# drops layer 1's own; every parameter is loaded, so only the tensor left unconsumed tells.
class BorrowedWeightAcctLlamaForCausalLM(LlamaForCausalLM):
    example_config: ClassVar[dict] = _example("BorrowedWeightAcctLlamaForCausalLM")

    def load_weights(self, weights: Weights) -> set[str]:
        def borrowed() -> Iterator[tuple[str, CheckpointTensor]]:
            for name, tensor in weights:
                if name == "model.layers.1.mlp.down_proj.weight":
                    continue
                yield name, tensor
                if name == "model.layers.0.mlp.down_proj.weight":
                    yield "model.layers.1.mlp.down_proj.weight", tensor

        return super().load_weights(borrowed())


# 2. The loader: lm_head tied to the embedding while loading although config.json says untied, and the checkpoint's
# lm_head.weight dropped; no parameter is left unloaded.
class DroppedHeadAcctLlamaForCausalLM(LlamaForCausalLM):
    example_config: ClassVar[dict] = _example("DroppedHeadAcctLlamaForCausalLM")

    def load_weights(self, weights: Weights) -> set[str]:
        self.lm_head = self.model.embed_tokens
        return super().load_weights((name, tensor) for name, tensor in weights if not name.startswith("lm_head."))


# 3. The checkpoint oracle: layer 1's post-attention norm weight reset to ones after loading.
class OverwrittenNormAcctLlamaForCausalLM(LlamaForCausalLM):
    example_config: ClassVar[dict] = _example("OverwrittenNormAcctLlamaForCausalLM")

    def load_weights(self, weights: Weights) -> set[str]:
        loaded = super().load_weights(weights)
        with torch.no_grad():
            self.get_parameter("model.layers.1.post_attention_layernorm.weight").fill_(1.0)
        return loaded


# 4. The checkpoint oracle: layer 1's key rows of the fused qkv_proj scaled by 1.01 after loading (a softmax
# temperature folded into the weight); q and v are the file's, so only k_proj's tensor differs.
class ScaledKeyAcctLlamaForCausalLM(LlamaForCausalLM):
    example_config: ClassVar[dict] = _example("ScaledKeyAcctLlamaForCausalLM")

    def load_weights(self, weights: Weights) -> set[str]:
        loaded = super().load_weights(weights)
        attn = cast(LlamaAttention, self.get_submodule("model.layers.1.self_attn"))
        with torch.no_grad():
            attn.qkv_proj.weight[attn.q_size:attn.q_size + attn.kv_size].mul_(1.01)
        return loaded


# 5. The checkpoint oracle: lm_head tied to the embedding when built although config.json says untied (its
# checkpoint then holds no lm_head.weight, and its weights mapper skips one).
class TiedHeadAcctLlamaForCausalLM(LlamaForCausalLM):
    example_config: ClassVar[dict] = _example("TiedHeadAcctLlamaForCausalLM")

    def __init__(self, config: HFConfig, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, quant_config)
        self.lm_head = self.model.embed_tokens

    def make_weights_mapper(self, config: HFConfig) -> WeightsMapper:
        return WeightsMapper(mapping=STACKED_PARAMS_MAPPING, skip=("rotary_emb.inv_freq", "lm_head."))


class ScaledOutputMLP(LlamaMLP):
    """Llama's MLP with a per-channel output scale in a persistent buffer (ones when built)."""

    out_scale: torch.Tensor

    def __init__(self, hidden_size: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(hidden_size, *args, **kwargs)
        self.register_buffer("out_scale", torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.out_scale


class ScaledOutputDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: HFConfig, layer_idx: int) -> nn.Module:
        if layer_idx != 1:
            return super().make_mlp(config, layer_idx)
        return ScaledOutputMLP(config.hidden_size, config.intermediate_size, quant_config=self.quant_config,
                               prefix=f"{self.prefix}.mlp")


# 6. The checkpoint oracle: layer 1's MLP keeps its output scale in a persistent buffer that nothing loads and
# nothing declares derived: its value is whatever the build left.
class UnloadedBufferAcctLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = ScaledOutputDecoderLayer
    example_config: ClassVar[dict] = _example("UnloadedBufferAcctLlamaForCausalLM")


class _RefLlama(LlamaForCausalLM):
    enginecheck_reference: ClassVar[str] = "LlamaForCausalLM"


class TiedAcctLlamaForCausalLM(_RefLlama):
    """Clean twin: tie_word_embeddings true and lm_head tied to the embedding (the checkpoint holds no lm_head)."""

    example_config: ClassVar[dict] = _example("TiedAcctLlamaForCausalLM", tie_word_embeddings=True)


class CheckpointInvFreqRotary(RotaryEmbedding):
    """Rotary embedding whose inverse frequencies are a parameter, as checkpoints that store them have it: derived
    from config.json when built, and never loaded."""

    def __init__(self, head_size: int, rope_parameters: Mapping[str, Any]) -> None:
        super().__init__(head_size, rope_parameters)
        inv_freq = self.inv_freq
        del self.inv_freq
        self.inv_freq = nn.Parameter(inv_freq, requires_grad=False)


class InvFreqDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        if layer_idx == 1:
            self.self_attn.rotary_emb = CheckpointInvFreqRotary(self.self_attn.head_dim, get_rope_parameters(config))


class DerivedParamAcctLlamaForCausalLM(_RefLlama):
    """Clean twin: its checkpoint carries layer 1's rotary_emb.inv_freq (as transformers before 4.31 wrote every
    layer's), which Llama's weights mapper declares unused; the model derives that parameter from config.json and
    says so by returning its name from load_weights."""

    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = InvFreqDecoderLayer
    example_config: ClassVar[dict] = _example("DerivedParamAcctLlamaForCausalLM")

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(weights) | {"model.layers.1.self_attn.rotary_emb.inv_freq"}


class DerivedBufferAcctLlamaForCausalLM(_RefLlama):
    """Clean twin of 6: the same persistent output scale, declared derived (its name in the weights mapper's skip)."""

    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = ScaledOutputDecoderLayer
    example_config: ClassVar[dict] = _example("DerivedBufferAcctLlamaForCausalLM")

    def make_weights_mapper(self, config: HFConfig) -> WeightsMapper:
        base = super().make_weights_mapper(config)
        return WeightsMapper(mapping=base.mapping, skip=(*base.skip, "mlp.out_scale"))
