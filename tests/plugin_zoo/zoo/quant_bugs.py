"""Quantization bugs a model author can make, in a registry of their own."""

import torch.nn.functional as F

from engine_ref.model_executor.layers.linear import MergedColumnParallelLinear, _load_rows
from engine_ref.model_executor.model_loader.weight_utils import check_shape
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine_ref.model_executor.models.registry import _ModelRegistry


class RankZeroScaleLinear(MergedColumnParallelLinear):
    """The bug: a per-channel weight_scale ([rows, 1]) is read from rank 0's rows on every rank."""

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 2 and param.shape[1] == 1:
            check_shape(loaded.name, loaded, param.checkpoint_shapes[shard_id])
            offset, size, _ = self.output_shard(shard_id)
            _load_rows(param, loaded, 0, offset, size, 0)
        else:
            super().weight_loader(param, loaded, shard_id)


class RankZeroScaleMLP(LlamaMLP):
    def __init__(self, hidden_size, intermediate_size, hidden_act="silu", bias=False, quant_config=None, prefix=""):
        super().__init__(hidden_size, intermediate_size, hidden_act, bias, quant_config, prefix)
        self.gate_up_proj = RankZeroScaleLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")


class RankZeroScaleDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_idx):
        return RankZeroScaleMLP(config.hidden_size, config.intermediate_size, quant_config=self.quant_config,
                                prefix=f"{self.prefix}.mlp")


class RankZeroScaleLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = RankZeroScaleDecoderLayer


class RawWeightMLP(LlamaMLP):
    """The bug: gate_up_proj's weight is used directly, bypassing its quant method (and so its scale)."""

    def forward(self, x):
        return self.down_proj(self.act_fn(F.linear(x, self.gate_up_proj.weight.to(x.dtype))))


class RawWeightDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_idx):
        return RawWeightMLP(config.hidden_size, config.intermediate_size, quant_config=self.quant_config,
                            prefix=f"{self.prefix}.mlp")


class RawWeightLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = RawWeightDecoderLayer


REGISTRY = _ModelRegistry({})
REGISTRY.register_model("CleanTwinLlamaForCausalLM", "zoo.planted_clean:CleanTwinLlamaForCausalLM")
REGISTRY.register_model("QuantScaleLlamaForCausalLM", "zoo.planted_quant:QuantScaleLlamaForCausalLM")
REGISTRY.register_model("LlavaForConditionalGeneration",
                        "engine_ref.model_executor.models.llava:LlavaForConditionalGeneration")
REGISTRY.register_model("RankZeroScaleLlamaForCausalLM", "zoo.quant_bugs:RankZeroScaleLlamaForCausalLM")
REGISTRY.register_model("RawWeightLlamaForCausalLM", "zoo.quant_bugs:RawWeightLlamaForCausalLM")
