"""The quantization seam (vLLM's): a config per method hands each layer a method with three steps.

- ``create_weights(layer)``: register the layer's parameters, each with its ``weight_loader`` and
  ``checkpoint_shapes`` (the loader contract of weight_utils);
- ``process_weights_after_loading(layer)``: after the checkpoint is in, convert on the fly;
- ``apply(layer, x, ...)``: the layer's computation.

The layer stays one class; the methods vary beside it. Parameters are plain tensors, so the memory
accounting (tensor storage bytes) counts 1 byte per 8-bit weight plus the scales by construction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import torch
from torch import nn

from engine_ref.errors import QuantizationError, WeightLoadError

if TYPE_CHECKING:
    from engine_ref.model_executor.layers.fused_moe import FusedMoE
    from engine_ref.model_executor.layers.linear import LinearBase

LayerT = TypeVar("LayerT", bound=nn.Module)


class QuantizeMethodBase(ABC, Generic[LayerT]):
    """What one layer does to hold and use its (possibly quantized) weights."""

    @abstractmethod
    def create_weights(self, layer: LayerT) -> None:
        """Register the layer's weight parameters, with their weight loaders."""

    def process_weights_after_loading(self, layer: LayerT) -> None:
        """Convert the loaded weights (on-the-fly quantization); nothing by default."""
        return


class LinearMethodBase(QuantizeMethodBase["LinearBase"]):
    """The method of a linear layer: ``apply`` computes ``x W^T + bias`` from the layer's parameters."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...


class FusedMoEMethodBase(QuantizeMethodBase["FusedMoE"]):
    """The method of an MoE layer's experts: ``apply`` runs the routed tokens through them (unreduced)."""

    @abstractmethod
    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
              ) -> torch.Tensor: ...


class QuantizationConfig(ABC):
    """One quantization method's settings, read from config.json's ``quantization_config`` or defaulted.

    ``cls()`` quantizes an unquantized checkpoint on the fly; ``cls.from_config(hf_quantization_config)``
    loads a checkpoint that is already quantized.
    """

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The method's name, as in ``quantization=`` and ``quantization_config["quant_method"]``."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """The config of a pre-quantized checkpoint, from its ``quantization_config`` dict."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase[Any]:
        """The method for ``layer`` (named ``prefix`` in the model); QuantizationError if it has none."""

    def on_the_fly(self) -> QuantizationConfig:
        """This method with the same settings, quantizing model-dtype weights after loading: what
        ``load_format='dummy'`` builds for a pre-quantized checkpoint (the same parameters, with valid scales).
        QuantizationError for a method that only loads checkpoints it did not quantize itself."""
        raise QuantizationError(
            f"{self.get_name()} cannot quantize weights at startup, so load_format='dummy' cannot make random "
            f"{self.get_name()} weights; load the checkpoint's weights (load_format='safetensors').")


MethodT = TypeVar("MethodT", bound=QuantizeMethodBase[Any])


def select_quant_method(quant_config: QuantizationConfig | None, layer: nn.Module, prefix: str,
                        kind: type, unquantized: Callable[[], MethodT]) -> MethodT:
    """``unquantized()`` without a config; otherwise the config's method, which must be a ``kind``."""
    if quant_config is None:
        return unquantized()
    method = quant_config.get_quant_method(layer, prefix)
    if not isinstance(method, kind):
        raise QuantizationError(
            f"{quant_config.get_name()} gave {prefix or type(layer).__name__} a {type(method).__name__}, "
            f"which is not a {kind.__name__}; its get_quant_method must return one for this layer.")
    return cast(MethodT, method)


def is_layer_skipped(prefix: str, ignored_layers: list[str]) -> bool:
    """Whether a module name matches an entry of ``ignored_layers`` / ``modules_to_not_convert``.

    As in transformers, an entry matches a module whose name contains it as whole dotted parts.
    """
    parts = f".{prefix}."
    return any(f".{name.strip('.')}." in parts for name in ignored_layers)


def check_checkpoint_dtype(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    """A quantized parameter only takes checkpoint tensors already in its dtype (``copy_`` would cast)."""
    expected = getattr(param, "checkpoint_dtype", None)
    if expected is not None and tensor.dtype != expected:
        raise WeightLoadError(
            f"tensor {name!r} is {tensor.dtype}, but the quantized checkpoint layout stores it as {expected}. "
            f"The checkpoint is not quantized that way: drop its quantization_config, or load the "
            f"unquantized checkpoint with quantization=<method> to quantize it at startup."
        )


def process_weights_after_loading(model: nn.Module) -> None:
    """Give every layer's quant method its after-loading step (call once the checkpoint is loaded)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(module)
