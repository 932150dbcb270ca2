"""A planted bug for the load check's TP diagnosis: layer 1's MLP activation returns a layout the diagnosis cannot
put back together (its shard padded to a multiple of 48 columns), and it is also where TP=2 goes wrong. The
down_proj after it is right, but its output differs (its input did): a diagnosis that skips what it cannot compare
blames down_proj's collective."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine_ref.config import HFConfig
from engine_ref.distributed.parallel_state import get_tp_group
from engine_ref.model_executor.layers.activation import SiluAndMul
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

PAD = 48  # columns: the width an imagined aligned kernel wants


class PaddedSiluAndMul(SiluAndMul):
    """silu(gate) * up, padded with zeros to a multiple of PAD columns. The bug: it divides by the TP size, as if
    its output were summed over the ranks (it is not: down_proj sums its own partial products)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x) / get_tp_group().world_size
        return F.pad(out, (0, -out.shape[-1] % PAD))


class PaddedMLP(LlamaMLP):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False,
                 prefix: str = "") -> None:
        super().__init__(hidden_size, intermediate_size, hidden_act, bias, prefix=prefix)
        self.act_fn = PaddedSiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(self.act_fn(gate_up)[..., :gate_up.shape[-1] // 2])  # without the padding


class PaddedMLPDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: HFConfig, layer_idx: int) -> nn.Module:
        if layer_idx != 1:
            return super().make_mlp(config, layer_idx)
        return PaddedMLP(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu"),
                         bias=config.get("mlp_bias", False), prefix=f"{self.prefix}.mlp")


class PaddedActLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = PaddedMLPDecoderLayer
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["PaddedActLlamaForCausalLM"]}
