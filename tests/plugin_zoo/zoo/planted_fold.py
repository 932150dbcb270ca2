"""A planted pair of independent bugs, for the folding of dependent checks: layer 1's down_proj loads the input
columns of the other rank (right at TP=1, wrong at TP=2: load[tp=2] fails), and every build starts a helper process
that is never stopped (startup fails, at TP=2 too). The leak has nothing to do with the sharding: startup must fail
for it, not be skipped because load[tp=2] failed."""

from __future__ import annotations

import subprocess
import sys
from typing import ClassVar

from torch import nn

from engine_ref.config import HFConfig
from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from zoo.engine_models import BadShardMLP


class Layer1BadShardDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: HFConfig, layer_idx: int) -> nn.Module:
        if layer_idx != 1:
            return super().make_mlp(config, layer_idx)
        return BadShardMLP(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu"))


class ShardAndLeakLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Layer1BadShardDecoderLayer
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["ShardAndLeakLlamaForCausalLM"]}

    def __init__(self, config: HFConfig, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, quant_config)
        self.helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
