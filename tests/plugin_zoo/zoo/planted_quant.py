"""A planted bug for the quant check: layer 1's ``down_proj`` multiplies its ``weight_scale`` by 1.05 after
loading (a scale fix-up meant for another checkpoint format, applied where it does not belong). It happens in
``process_weights_after_loading``, so the converted and the pre-quantized engines agree at every TP size and
the logits stay well inside the loose bound; only the dequantized-weight oracle tells it apart. Without
quantization the model is Llama exactly, so every other check passes."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine_ref.config import HFConfig
from engine_ref.model_executor.layers.linear import LinearBase, RowParallelLinear, UnquantizedLinearMethod
from engine_ref.model_executor.layers.quantization.base_config import LinearMethodBase, QuantizationConfig
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

SCALE_ERROR = 1.05


class ScaleFixupMethod(LinearMethodBase):
    """The layer's quant method, then the bug: ``weight_scale *= 1.05`` once the weights are in."""

    def __init__(self, method: LinearMethodBase) -> None:
        self.method = method

    def create_weights(self, layer: LinearBase) -> None:
        self.method.create_weights(layer)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        self.method.process_weights_after_loading(layer)
        layer.get_parameter("weight_scale").data.mul_(SCALE_ERROR)

    def dequantized_weights(self, layer: LinearBase, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        return self.method.dequantized_weights(layer, dtype)  # type: ignore[attr-defined]

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.method.apply(layer, x, bias)


class ScaleFixupRowParallelLinear(RowParallelLinear):
    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(input_size, output_size, bias=bias, quant_config=quant_config, prefix=prefix)
        if not isinstance(self.quant_method, UnquantizedLinearMethod):
            self.quant_method = ScaleFixupMethod(self.quant_method)


class ScaleFixupMLP(LlamaMLP):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(hidden_size, intermediate_size, hidden_act, bias, quant_config, prefix)
        self.down_proj = ScaleFixupRowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                                     quant_config=quant_config, prefix=f"{prefix}.down_proj")


class ScaleFixupDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: HFConfig, layer_idx: int) -> nn.Module:
        if layer_idx != 1:
            return super().make_mlp(config, layer_idx)
        return ScaleFixupMLP(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu"),
                             bias=config.get("mlp_bias", False), quant_config=self.quant_config,
                             prefix=f"{self.prefix}.mlp")


class QuantScaleLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = ScaleFixupDecoderLayer
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["QuantScaleLlamaForCausalLM"]}
