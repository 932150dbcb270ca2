"""Capability markers a model class declares, and the ModelInfo the registry derives from them.

As in vLLM, a model opts in by inheriting a marker (``SupportsMultiModal``...) whose ClassVar the
registry reads while inspecting the class in a subprocess. This module imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from engine_ref.model_executor.model_loader.weight_utils import CheckpointTensor

# Full-size published config.json files; a model class names one in ``reference_config`` so memory
# checks can predict the real model's fit (``engine-ref estimate``, ``--enginecheck-device-memory``).
REFERENCE_CONFIGS_DIR = Path(__file__).parent / "configs"


def reference_config_path(model_cls: type) -> Path | None:
    """The full-size config.json a model class declares (a file name in REFERENCE_CONFIGS_DIR, or a path)."""
    name = getattr(model_cls, "reference_config", None)
    return None if name is None else REFERENCE_CONFIGS_DIR / name


class VllmModel(Protocol):
    """What the engine calls on every model class beyond nn.Module's own (vLLM's ``VllmModel``);
    ``ModelInfo.from_model_cls`` refuses a class without it."""

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Load the checkpoint's tensors; return the names of the parameters loaded."""
        ...


class VllmModelForTextGeneration(VllmModel, Protocol):
    """A model that generates text (``ModelInfo.is_text_generation_model``): it turns hidden states into logits."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The vocabulary logits of each hidden state."""
        ...


class SupportsMultiModal:
    """The model takes images (or other modalities) beside token ids."""

    supports_multimodal: ClassVar[bool] = True


class SupportsLoRA:
    """The model runs LoRA adapters (``enable_lora``): after loading, the LoRAModelManager wraps its
    column- and row-parallel linear layers (``engine_ref.lora.utils.lora_targets``) in ``...WithLoRA``
    layers, under the module names PEFT gives the checkpoint's modules.

    Declared by Llama and the architectures built on it: Qwen2, and the mixtures of experts Mixtral
    and Qwen3-MoE, whose attention (and Qwen3-MoE's dense MLP layers) take adapters; their experts and
    routers are not wrapped (FusedMoE holds all experts in one tensor, not per-expert linear layers),
    so an adapter that targets them is refused by name. Llava does not declare it: the vision tower
    and the projector run on image patches, not on the tokens a LoRA batch maps to adapter slots,
    and PEFT names its language model's modules under another prefix.
    """

    supports_lora: ClassVar[bool] = True


class SupportsQuant:
    """The model runs quantized weights (``quantization=`` or a checkpoint's ``quantization_config``):
    its constructor takes ``quant_config`` and hands it, with each layer's module name as ``prefix``,
    to every linear layer and MoE expert block, which ask it for their quant method
    (``engine_ref.model_executor.layers.quantization``); embeddings, norms and the LM head stay unquantized.

    Declared by Llama and the architectures built on it (Qwen2, Mixtral, Qwen3-MoE). Llava does not
    declare it: its constructor builds the vision tower, the projector and its Llama language model
    without a quant_config, so a quantized Llava checkpoint (whose modules to skip are named with
    transformers' Llava prefixes) would not load; the config phase refuses it by name instead.
    """

    supports_quantization: ClassVar[bool] = True


class MixtureOfExperts:
    """The model routes tokens to experts."""

    is_moe: ClassVar[bool] = True


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about a model class before building it."""

    architecture: str
    module: str
    class_name: str
    is_text_generation_model: bool
    supports_multimodal: bool
    is_moe: bool
    supports_tp: bool
    supports_pp: bool
    supports_lora: bool
    supports_quantization: bool
    has_example_config: bool

    @classmethod
    def from_model_cls(cls, architecture: str, model_cls: type) -> ModelInfo:
        """Derive the info from the class's markers; raise TypeError if it is not a model class."""
        missing = [name for name in ("forward", "load_weights") if not callable(getattr(model_cls, name, None))]
        if missing:
            raise TypeError(
                f"{model_cls.__module__}.{model_cls.__qualname__} is not a model class: it has no "
                f"{' or '.join(missing)}(); a model must define forward() and load_weights(weights) -> set[str]."
            )
        return cls(
            architecture=architecture,
            module=model_cls.__module__,
            class_name=model_cls.__qualname__,
            is_text_generation_model=callable(getattr(model_cls, "compute_logits", None)),
            supports_multimodal=getattr(model_cls, "supports_multimodal", False),
            is_moe=getattr(model_cls, "is_moe", False),
            supports_tp=getattr(model_cls, "supports_tp", True),
            supports_pp=getattr(model_cls, "supports_pp", False),
            supports_lora=getattr(model_cls, "supports_lora", False),
            supports_quantization=getattr(model_cls, "supports_quantization", False),
            has_example_config=isinstance(getattr(model_cls, "example_config", None), dict),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelInfo:
        """Rebuild from ``to_dict`` output; raises TypeError/KeyError on a stale or foreign dict."""
        names = {f.name for f in fields(cls)}
        if set(data) != names:
            raise KeyError(f"fields differ: {sorted(set(data) ^ names)}")
        return cls(**data)
