"""Write tiny random Hugging Face layout checkpoints from an architecture's example config.

There is no model hub here: tests, the CLI and the plugin generate checkpoints instead. The
tensors written are exactly those the model loads (names and full shapes come from the model's
own ``checkpoint_shapes`` and weights mapper), drawn from a generator with a fixed seed. Values
are scaled (N(0, 1/fan_in) for matrices, ones plus noise for norms) so a tiny random model has
decisive logits and greedy decoding is stable across implementations.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from engine_ref.config import HFConfig
from engine_ref.distributed.parallel_state import tensor_parallel_state
from engine_ref.errors import ConfigError
from engine_ref.model_executor.model_loader.weight_utils import expected_checkpoint_tensors
from engine_ref.model_executor.models.registry import ModelRegistry, _ModelRegistry

if TYPE_CHECKING:
    from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig


def example_config(architecture: str, registry: _ModelRegistry = ModelRegistry) -> dict[str, Any]:
    """The tiny config an architecture declares (``example_config`` on its class)."""
    model_cls = registry.resolve_model_cls(architecture)
    config = getattr(model_cls, "example_config", None)
    if not isinstance(config, dict):
        raise ConfigError(
            f"{architecture} declares no example_config; give its class an `example_config` dict "
            f"(a tiny config.json) so a checkpoint can be generated."
        )
    return copy.deepcopy(config)


def _random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:
        center = 1.0 if "norm" in name and name.endswith("weight") else 0.0
        return center + 0.1 * torch.randn(shape, generator=generator)
    fan_in = math.prod(shape[1:])
    return torch.randn(shape, generator=generator) / math.sqrt(fan_in)


def expected_tensors(hf_config: dict[str, Any], architecture: str, registry: _ModelRegistry = ModelRegistry,
                     quant_config: QuantizationConfig | None = None) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the model loads, with its full shape (built on the meta device).

    With a pre-quantized ``quant_config``, its scales too (``...weight_scale``).
    """
    model_cls = registry.resolve_model_cls(architecture)
    kwargs = {} if quant_config is None else {"quant_config": quant_config}
    with tensor_parallel_state(0, 1), torch.device("meta"):
        model = model_cls(HFConfig(json.loads(json.dumps(hf_config), object_hook=HFConfig)), **kwargs)
    return expected_checkpoint_tensors(model, model.weights_mapper)


def _save(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """save_file, with config.json's permissions (safetensors writes 0600, readable by its owner only)."""
    save_file(tensors, str(file), metadata={"format": "pt"})
    shutil.copymode(file.parent / "config.json", file)


def make_checkpoint(architecture: str, path: str | Path, *, seed: int = 0, dtype: str = "float32",
                    overrides: dict[str, Any] | None = None, num_shards: int = 1, fmt: str = "safetensors",
                    registry: _ModelRegistry = ModelRegistry) -> Path:
    """Write ``config.json`` and random weights for ``architecture`` into ``path``; return it.

    ``overrides`` update the example config (top level). ``num_shards > 1`` writes
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``; ``fmt="pt"``
    writes ``pytorch_model.bin`` instead.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = example_config(architecture, registry)
    config.update(overrides or {})
    config["architectures"] = [architecture]
    config["torch_dtype"] = dtype
    generator = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    tensors = {
        name: _random_tensor(name, shape, generator).to(torch_dtype)
        for name, shape in sorted(expected_tensors(config, architecture, registry).items())
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if fmt == "pt":
        torch.save(tensors, path / "pytorch_model.bin")
        return path
    if num_shards == 1:
        _save(tensors, path / "model.safetensors")
        return path
    names = list(tensors)
    per_shard = math.ceil(len(names) / num_shards)
    weight_map = {}
    for i in range(num_shards):
        shard_name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {name: tensors[name] for name in names[i * per_shard:(i + 1) * per_shard]}
        _save(shard, path / shard_name)
        weight_map.update(dict.fromkeys(shard, shard_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
