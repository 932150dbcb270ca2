"""Model loaders by load_format: build the model for this rank, then fill its parameters.

- ``safetensors``: HF layout, one file or shards listed in ``model.safetensors.index.json``,
  read through ``safe_open`` so each rank reads only its slices.
- ``pt``: ``pytorch_model*.bin`` / ``*.pt`` through ``torch.load(weights_only=True)`` only.
- ``dummy``: random values, no files (startup and memory checks without a checkpoint).

The checkpoint is fully accounted for, both ways (vLLM checks only the first): every parameter is
loaded (the names the model's ``load_weights`` returns), and every checkpoint tensor is consumed
(``CheckpointTensor.load`` of at least this rank's part) unless the model's ``weights_mapper.skip``
declares it unused; a model that drops a tensor silently fails to load, naming it.

A float64 tensor is refused (WeightLoadError) before its bytes are read: engine_ref never runs in
float64 (config.json's torch_dtype may not say it either), and casting it silently would lose precision.

With a quantization config, the layers hold the method's parameters, and once the checkpoint is
in, ``process_weights_after_loading`` converts model-dtype weights on the fly. ``dummy`` always
quantizes on the fly (random 8-bit values would have no meaningful scales): the parameters, and so
the bytes, are those a pre-quantized checkpoint loads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engine_ref.config import EngineConfig, LoadConfig
from engine_ref.errors import WeightLoadError
from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig, process_weights_after_loading
from engine_ref.model_executor.model_loader.weight_utils import (
    CheckpointTensor,
    LoadStats,
    checkpoint_shapes,
    missing_tensors_error,
    unconsumed_tensors_error,
)
from engine_ref.model_executor.models.interfaces import VllmModel
from engine_ref.model_executor.models.registry import RegisteredModel

SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"

Weights = Iterator[tuple[str, CheckpointTensor]]


def get_model_cls(config: EngineConfig) -> type[nn.Module]:
    """The model class the config phase resolved (imported here, in the worker)."""
    info = config.model_info
    if info is None:
        from engine_ref.model_executor.models.registry import ModelRegistry

        return ModelRegistry.resolve_model_cls(config.model_config.architecture)
    return RegisteredModel(info.module, info.class_name).load_model_cls()


def initialize_model(config: EngineConfig, device: torch.device,
                     quant_config: QuantizationConfig | None = None) -> nn.Module:
    """Build this rank's model on ``device`` in the model dtype, parameters left uninitialized.

    ``quant_config`` (default: the config's) hands the layers their quant methods.
    """
    model_cls = get_model_cls(config)
    quant_config = quant_config or config.quant_config
    kwargs = {} if quant_config is None else {"quant_config": quant_config}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.model_config.torch_dtype)
    try:
        with torch.device(device):
            return model_cls(config.model_config.hf_config, **kwargs)
    finally:
        torch.set_default_dtype(previous)


class BaseModelLoader:
    """Builds and loads the model of one rank; ``stats`` says what it read."""

    def __init__(self, load_config: LoadConfig) -> None:
        self.load_config = load_config
        self.stats = LoadStats()

    def load_model(self, config: EngineConfig, device: torch.device) -> nn.Module:
        model = initialize_model(config, device, self.quant_config(config))
        with torch.no_grad():
            self.load_weights(model, config)
            process_weights_after_loading(model)
        return model.eval()

    def quant_config(self, config: EngineConfig) -> QuantizationConfig | None:
        """The quantization the model is built with: the config's."""
        return config.quant_config

    def load_weights(self, model: nn.Module, config: EngineConfig) -> None:
        raise NotImplementedError


class DefaultModelLoader(BaseModelLoader):
    """Loads safetensors or pt checkpoints in the Hugging Face layout."""

    def load_weights(self, model: nn.Module, config: EngineConfig) -> None:
        model_dir = Path(config.model_config.model)
        consumed: set[str] = set()
        if self.load_config.load_format == "pt":
            weights = self._pt_weights(model_dir, consumed)
        else:
            weights = self._safetensors_weights(model_dir, consumed)
        offered: dict[str, str] = {}  # checkpoint tensor name -> its file
        stream = _recorded(weights, offered)
        loaded = cast(VllmModel, model).load_weights(stream)  # ModelInfo checked the class has it
        for _ in stream:  # the tensors load_weights stopped before: they are not consumed either
            pass
        mapper = getattr(model, "weights_mapper", None)
        not_loaded = [name for name, _ in model.named_parameters() if name not in loaded]
        if not_loaded:  # the model's own load_weights skipped parameters
            names = [mapper.to_checkpoint(n, s) if mapper else n
                     for n in not_loaded for s in checkpoint_shapes(model.get_parameter(n))]
            raise missing_tensors_error(names)
        skip = mapper.skip if mapper else ()
        unconsumed = {name: origin for name, origin in offered.items()
                      if name not in consumed and not any(part in name for part in skip)}
        if unconsumed:
            raise unconsumed_tensors_error(type(model).__name__, unconsumed)

    def _safetensors_weights(self, model_dir: Path, consumed: set[str]) -> Weights:
        index = model_dir / SAFETENSORS_INDEX
        files = _files_from_index(index) if index.exists() else sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise WeightLoadError(
                f"no *.safetensors files in {model_dir}; write the weights there, or use load_format='pt' "
                f"for pytorch_model.bin, or load_format='dummy' for random weights."
            )
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise WeightLoadError(
                    f"{path} is not a readable safetensors file ({e}); it is truncated or corrupt. "
                    f"Re-download or regenerate the checkpoint."
                ) from None
            with handle as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle has keys(), not __iter__
                    tensor_slice = f.get_slice(name)
                    if tensor_slice.get_dtype() == "F64":
                        raise _float64_error(name, path)
                    yield name, CheckpointTensor(name, tensor_slice, tensor_slice.get_shape(), path.name, self.stats,
                                                 consumed=consumed)

    def _pt_weights(self, model_dir: Path, consumed: set[str]) -> Weights:
        index = model_dir / PT_INDEX
        if index.exists():
            files = _files_from_index(index)
        else:
            files = sorted([*model_dir.glob("pytorch_model*.bin"), *model_dir.glob("*.pt")])
        if not files:
            raise WeightLoadError(f"no pytorch_model*.bin or *.pt files in {model_dir} for load_format='pt'.")
        for path in files:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - torch raises several types for bad files
                raise WeightLoadError(
                    f"{path} could not be loaded with torch.load(weights_only=True): {_torch_load_reason(e)}. It is "
                    f"corrupt, or it pickles objects other than tensors, which engine_ref refuses to unpickle."
                ) from None
            if not isinstance(state, dict):
                raise WeightLoadError(f"{path} holds a {type(state).__name__}, not a dict of tensors.")
            for name, tensor in state.items():
                if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float64:
                    raise _float64_error(name, path)
                yield name, CheckpointTensor.from_tensor(name, tensor, path.name, self.stats, consumed)


def _recorded(weights: Weights, offered: dict[str, str]) -> Weights:
    """``weights``, each tensor's name and file recorded in ``offered`` as it is handed on."""
    for name, tensor in weights:
        offered[name] = tensor.origin
        yield name, tensor


def _float64_error(name: str, path: Path) -> WeightLoadError:
    return WeightLoadError(
        f"tensor {name!r} in {path} is stored as float64, which engine_ref does not run in (float32, float16, "
        f"bfloat16), and refuses to cast silently: convert the checkpoint (e.g. tensor.to(torch.float32)) and save "
        f"it again.")


def _torch_load_reason(error: Exception) -> str:
    """The one line of torch.load's error that says why (its weights_only message spans many lines)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next((line for line in lines if line.startswith("WeightsUnpickler error:")), None)
    return reason or (lines[0] if lines else type(error).__name__)


def _files_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise WeightLoadError(f"{index} is not a valid index (needs a 'weight_map'): {e}") from None
    files = [index.parent / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise WeightLoadError(
            f"{index.name} names {', '.join(missing)}, which does not exist in {index.parent}; "
            f"the checkpoint is incomplete: download or copy the missing shard(s)."
        )
    return files


class DummyModelLoader(BaseModelLoader):
    """Random weights, no files: every rank draws its own shard from a seeded generator (quantized on the fly)."""

    def quant_config(self, config: EngineConfig) -> QuantizationConfig | None:
        return None if config.quant_config is None else config.quant_config.on_the_fly()

    def load_weights(self, model: nn.Module, config: EngineConfig) -> None:
        generator = torch.Generator().manual_seed(config.model_config.seed)
        for param in model.parameters():
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)
            param.data.copy_(values)


def get_model_loader(load_config: LoadConfig) -> BaseModelLoader:
    """The loader for ``load_config.load_format``."""
    if load_config.load_format == "dummy":
        return DummyModelLoader(load_config)
    return DefaultModelLoader(load_config)
