"""A Llama whose LoRA shards wrongly at TP=2 while its own weights shard right, in its own registry
(``--enginecheck-target=zoo.lora_models:REGISTRY``), beside zoo.lora_bypass's Llama that skips one adapter at every
TP size and its clean twin."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from engine_ref.config import HFConfig
from engine_ref.model_executor.layers.linear import RowParallelLinear, _load_rows
from engine_ref.model_executor.model_loader.weight_utils import CheckpointTensor, ShardId, check_shape
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine_ref.model_executor.models.registry import _ModelRegistry


class OwnColumnsRowParallelLinear(RowParallelLinear):
    """The bug: the loader picks this rank's input columns itself, and ``input_start`` (the columns the
    layer says it holds, which LoRA's A is sliced by) is left at 0. Right at TP=1, and the base weights
    are right at TP=2; LoRA's A is not."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias=bias)
        self.input_start = 0

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId = None) -> None:
        check_shape(loaded.name, loaded, param.checkpoint_shapes[None])
        size = param.shape[1]
        _load_rows(param, loaded, 1, 0, size, self.tp_rank * size)


class LoRAShardMLP(LlamaMLP):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False
                 ) -> None:
        super().__init__(hidden_size, intermediate_size, hidden_act, bias)
        self.down_proj = OwnColumnsRowParallelLinear(intermediate_size, hidden_size, bias=bias)


class LoRAShardDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: HFConfig, layer_idx: int) -> nn.Module:
        return LoRAShardMLP(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu"))


class LoRAShardLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = LoRAShardDecoderLayer
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["LoRAShardLlamaForCausalLM"]}


REGISTRY = _ModelRegistry({})
REGISTRY.register_model("LoRAShardLlamaForCausalLM", "zoo.lora_models:LoRAShardLlamaForCausalLM")
REGISTRY.register_model("LoRABypassLlamaForCausalLM", "zoo.lora_bypass:LoRABypassLlamaForCausalLM")
REGISTRY.register_model("LoRABypassTwinLlamaForCausalLM", "zoo.lora_bypass:LoRABypassTwinLlamaForCausalLM")
