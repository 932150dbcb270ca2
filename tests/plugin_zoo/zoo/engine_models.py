"""Llama variants that build and run, but shard wrongly or leave something behind."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from typing import ClassVar

from torch import nn

from engine_ref.config import HFConfig
from engine_ref.model_executor.layers.linear import RowParallelLinear, _load_rows
from engine_ref.model_executor.model_loader.weight_utils import CheckpointTensor, ShardId, check_shape
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class MirroredRowParallelLinear(RowParallelLinear):
    """The bug: rank r loads the input columns of rank tp-1-r (right at TP=1, wrong at TP=2)."""

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId = None) -> None:
        check_shape(loaded.name, loaded, param.checkpoint_shapes[None])
        size = param.shape[1]
        _load_rows(param, loaded, 1, 0, size, (self.tp_size - 1 - self.tp_rank) * size)


class BadShardMLP(LlamaMLP):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False
                 ) -> None:
        super().__init__(hidden_size, intermediate_size, hidden_act, bias)
        self.down_proj = MirroredRowParallelLinear(intermediate_size, hidden_size, bias=bias)


class BadShardDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: HFConfig, layer_idx: int) -> nn.Module:
        return BadShardMLP(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu"))


class BadShardLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = BadShardDecoderLayer
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["BadShardLlamaForCausalLM"]}


class TempLeakLlamaForCausalLM(LlamaForCausalLM):
    """Unpacks something into a temp dir when built and never removes it."""

    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["TempLeakLlamaForCausalLM"]}

    def __init__(self, config: HFConfig) -> None:
        super().__init__(config)
        self.kernel_cache = tempfile.mkdtemp(prefix="zoo-kernel-cache-")


class ProcessLeakLlamaForCausalLM(LlamaForCausalLM):
    """Starts a helper process when built and never stops it."""

    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["ProcessLeakLlamaForCausalLM"]}

    def __init__(self, config: HFConfig) -> None:
        super().__init__(config)
        self.helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
