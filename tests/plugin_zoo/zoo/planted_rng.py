"""A planted bug for the load check's determinism run: layer 1's MLP adds Gaussian noise to its output (dropout
left in training mode, a sampling layer called at inference). Every run seeds its ranks alike, so TP=1 and TP=2
draw the same noise and agree; only two runs under different seeds tell it apart."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine_ref.config import HFConfig
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class NoisyMLP(LlamaMLP):
    """The bug: the output depends on the RNG."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + torch.randn_like(out)


class NoisyMLPDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: HFConfig, layer_idx: int) -> nn.Module:
        if layer_idx != 1:
            return super().make_mlp(config, layer_idx)
        return NoisyMLP(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu"),
                        bias=config.get("mlp_bias", False), quant_config=self.quant_config, prefix=f"{self.prefix}.mlp")


class RngMLPLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = NoisyMLPDecoderLayer
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["RngMLPLlamaForCausalLM"]}
