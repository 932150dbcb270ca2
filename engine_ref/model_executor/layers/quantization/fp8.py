"""fp8: float8_e4m3fn weights with float32 ``weight_scale``, weight-only on CPU (dequantized to x's dtype).

Checkpoint layouts read (config.json's ``quantization_config``, tensors beside each ``weight``):
- ``fp8`` (vLLM's, as AutoFP8 / llm-compressor write it): ``{"quant_method": "fp8",
  "activation_scheme": "dynamic", "ignored_layers": [...]}``, ``weight`` float8_e4m3fn and a
  per-tensor ``weight_scale`` ``[]``. Static activation scales (``input_scale``) and block-wise
  scales (``weight_block_size``, transformers' FineGrainedFP8 / DeepSeek) are refused.
- ``fbgemm_fp8`` (transformers' FbgemmFp8Config): ``{"quant_method": "fbgemm_fp8",
  "modules_to_not_convert": [...], "activation_scale_ub": ...}``, ``weight`` float8_e4m3fn and a
  per-output-channel ``weight_scale`` ``[out, 1]``. ``activation_scale_ub`` bounds activation
  scales, which a weight-only method does not have.

Without a checkpoint ``quantization_config`` (``Fp8Config()``), bf16/fp32 weights are quantized at
startup, per tensor (``fp8``) or per channel (``fbgemm_fp8``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine_ref.errors import QuantizationError
from engine_ref.model_executor.layers.quantization.scaled import ScaledQuantizationConfig

FP8_DTYPE_NAME = "float8_e4m3fn"


def fp8_dtype() -> torch.dtype:
    """torch.float8_e4m3fn, or QuantizationError on a torch build without it."""
    dtype = getattr(torch, FP8_DTYPE_NAME, None)
    if dtype is None:
        raise QuantizationError(
            f"this torch ({torch.__version__}) has no torch.{FP8_DTYPE_NAME}, which fp8 weights need; "
            f"install torch >= 2.1, or use quantization='int8'.")
    return dtype


class Fp8Config(ScaledQuantizationConfig):
    """fp8 weights with one scale per checkpoint tensor."""

    per_channel = False

    def __init__(self, is_checkpoint_serialized: bool = False, ignored_layers: Sequence[str] = ()) -> None:
        super().__init__(is_checkpoint_serialized, ignored_layers)
        self._dtype = fp8_dtype()

    @classmethod
    def get_name(cls) -> str:
        return "fp8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        cls.check_config(config, {"activation_scheme": ("dynamic",), "weight_block_size": (None,)})
        return cls(True, config.get("ignored_layers") or config.get("modules_to_not_convert") or ())

    def to_hf_config(self) -> dict[str, Any]:
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": self.ignored_layers}

    @property
    def weight_dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def qmax(self) -> float:
        return float(torch.finfo(self._dtype).max)

    def cast(self, x: torch.Tensor) -> torch.Tensor:
        # Clamped first: float rounding can put the amax element a hair above 448, which e4m3fn lacks.
        return x.clamp(-self.qmax, self.qmax).to(self._dtype)


class FbgemmFp8Config(Fp8Config):
    """fp8 weights with one scale per output channel (transformers' fbgemm_fp8 layout)."""

    per_channel = True

    @classmethod
    def get_name(cls) -> str:
        return "fbgemm_fp8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FbgemmFp8Config:
        cls.check_config(config, {})
        return cls(True, config.get("modules_to_not_convert") or ())

    def to_hf_config(self) -> dict[str, Any]:
        return {"quant_method": "fbgemm_fp8", "modules_to_not_convert": self.ignored_layers}
