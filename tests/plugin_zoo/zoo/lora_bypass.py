"""A Llama whose layer 1 silently skips its down_proj adapter, and its clean twin, both declaring transformers' Llama
their reference (registered in ``zoo.lora_models:REGISTRY``).

The bug: layer 1's MLP calls down_proj through a handle taken when the model was built (a fused activation-and-down
call), not through the attribute. The engine's LoRA wraps the attribute after loading (``set_submodule``), so the
handle still holds the bare layer: its adapter is never applied, at every TP size alike, while every other target
module applies its own (the output still changes with the adapter). Only transformers + PEFT sees it (lora[tp=1]).
The twin makes the same fused call with the attribute it reads at call time.
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import torch
from torch import nn

from engine_ref.config import HFConfig
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


def act_and_down(act: nn.Module, down: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """down(act(gate_up)): the fused call both MLPs make."""
    return down(act(gate_up))


class HandleMLP(LlamaMLP):
    """The bug: the fused call holds the down_proj of build time."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu") -> None:
        super().__init__(hidden_size, intermediate_size, hidden_act)
        self.fused_down = partial(act_and_down, self.act_fn, self.down_proj)  # a plain attribute, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused_down(self.gate_up_proj(x))


class TwinMLP(LlamaMLP):
    """The twin: the same fused call, given the down_proj the module holds now."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act_and_down(self.act_fn, self.down_proj, self.gate_up_proj(x))


def _layer(mlp_cls: type[LlamaMLP]) -> type[LlamaDecoderLayer]:
    class Layer(LlamaDecoderLayer):
        def make_mlp(self, config: HFConfig, layer_idx: int) -> nn.Module:
            if layer_idx != 1:
                return super().make_mlp(config, layer_idx)
            return mlp_cls(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu"))

    return Layer


class LoRABypassLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = _layer(HandleMLP)
    enginecheck_reference: ClassVar[str] = "LlamaForCausalLM"
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["LoRABypassLlamaForCausalLM"]}


class LoRABypassTwinLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = _layer(TwinMLP)
    enginecheck_reference: ClassVar[str] = "LlamaForCausalLM"
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["LoRABypassTwinLlamaForCausalLM"]}
