"""Weight quantization methods by name (vLLM's ``QUANTIZATION_METHODS`` / ``get_quantization_config``).

The methods are imported when asked for, so importing the layers does not import every method.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from engine_ref.errors import QuantizationError

if TYPE_CHECKING:
    from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig

QUANTIZATION_METHODS: tuple[str, ...] = ("fp8", "fbgemm_fp8", "int8")


def get_quantization_config(quantization: str) -> type[QuantizationConfig]:
    """The QuantizationConfig class of a method name; QuantizationError naming the known ones."""
    from engine_ref.model_executor.layers.quantization.fp8 import FbgemmFp8Config, Fp8Config
    from engine_ref.model_executor.layers.quantization.int8 import Int8Config

    methods: dict[str, type[QuantizationConfig]] = {
        "fp8": Fp8Config, "fbgemm_fp8": FbgemmFp8Config, "int8": Int8Config}
    if quantization not in methods:
        raise QuantizationError(
            f"quantization={quantization!r} is not a method engine_ref has; use one of {list(QUANTIZATION_METHODS)}.")
    return methods[quantization]


def get_quant_config(quantization: str | None, hf_quantization_config: Mapping[str, Any] | None
                     ) -> QuantizationConfig | None:
    """The engine's quantization: a pre-quantized checkpoint's (config.json's ``quantization_config``),
    else ``quantization=`` converting the checkpoint at startup, else none.

    QuantizationError when both are given and disagree.
    """
    if quantization is not None and not isinstance(quantization, str):
        raise QuantizationError(
            f"quantization={quantization!r} must be a method name, one of {list(QUANTIZATION_METHODS)}, or None.")
    if hf_quantization_config is None:
        return None if quantization is None else get_quantization_config(quantization)()
    method = hf_quantization_config.get("quant_method") if isinstance(hf_quantization_config, Mapping) else None
    if not isinstance(method, str):
        raise QuantizationError(
            f"config.json's quantization_config {hf_quantization_config!r} names no quant_method; a quantized "
            f"checkpoint says how it was quantized, e.g. {{\"quant_method\": \"fp8\"}}. Fix config.json, or remove "
            f"quantization_config if the weights are not quantized.")
    if quantization is not None and quantization != method:
        raise QuantizationError(
            f"quantization={quantization!r} was asked for, but the checkpoint is already quantized with "
            f"{method!r} (quantization_config in config.json); pass quantization={method!r} or leave it unset.")
    return get_quantization_config(method).from_config(dict(hf_quantization_config))
