"""int8: weight-only W8A16, int8 weights with symmetric per-output-channel float32 scales.

Checkpoint layout (engine_ref's; the tensors are those of compressed-tensors' channel-wise int8):
``quantization_config: {"quant_method": "int8", "modules_to_not_convert": [...]}``, ``weight`` int8
``[out, in]`` and ``weight_scale`` ``[out, 1]``, with ``W ~ weight * weight_scale`` and
``weight_scale = amax(|W row|) / 127``. Without a checkpoint ``quantization_config``
(``Int8Config()``), bf16/fp32 weights are quantized at startup.
"""

from __future__ import annotations

from typing import Any

import torch

from engine_ref.model_executor.layers.quantization.scaled import ScaledQuantizationConfig


class Int8Config(ScaledQuantizationConfig):
    """int8 weights, one scale per output channel, rounded to nearest."""

    per_channel = True

    @classmethod
    def get_name(cls) -> str:
        return "int8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Int8Config:
        cls.check_config(config, {})
        return cls(True, config.get("modules_to_not_convert") or config.get("ignored_layers") or ())

    def to_hf_config(self) -> dict[str, Any]:
        return {"quant_method": "int8", "modules_to_not_convert": self.ignored_layers}

    @property
    def weight_dtype(self) -> torch.dtype:
        return torch.int8

    @property
    def qmax(self) -> float:
        return 127.0

    def cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.round().clamp(-self.qmax, self.qmax).to(torch.int8)
