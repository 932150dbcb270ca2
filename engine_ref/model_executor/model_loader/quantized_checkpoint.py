"""Write pre-quantized tiny checkpoints (fp8, fbgemm_fp8, int8) in the layout their method loads.

The weights are ``make_checkpoint``'s (same architecture, seed, dtype and shards), each weight of a
quantized layer replaced by its 8-bit values plus ``weight_scale`` (in the weight's file),
computed over the whole checkpoint tensor exactly as on-the-fly quantization computes them at
any TP size: loading this checkpoint gives the parameters that ``quantization=METHOD`` gives on
the unquantized one. ``make_dequantized_checkpoint`` writes the reverse: the unquantized checkpoint of
the weights a pre-quantized one stands for, the exact oracle of a weight-only method.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from engine_ref.distributed.parallel_state import tensor_parallel_state
from engine_ref.errors import QuantizationError
from engine_ref.model_executor.layers.quantization import get_quantization_config
from engine_ref.model_executor.layers.quantization.scaled import ScaledQuantizationConfig
from engine_ref.model_executor.model_loader.checkpoint import expected_tensors, make_checkpoint
from engine_ref.model_executor.model_loader.loaders import SAFETENSORS_INDEX
from engine_ref.model_executor.models.interfaces import ModelInfo
from engine_ref.model_executor.models.registry import ModelRegistry, _ModelRegistry

SCALE_SUFFIX = "_scale"


def make_quantized_checkpoint(architecture: str, path: str | Path, quantization: str, *, seed: int = 0,
                              dtype: str = "float32", overrides: dict[str, Any] | None = None, num_shards: int = 1,
                              registry: _ModelRegistry = ModelRegistry) -> Path:
    """Write ``config.json`` (with ``quantization_config``) and quantized weights into ``path``; return it."""
    method = get_quantization_config(quantization)
    if not issubclass(method, ScaledQuantizationConfig):
        raise QuantizationError(f"no checkpoint writer for quantization={quantization!r}")
    if not ModelInfo.from_model_cls(architecture, registry.resolve_model_cls(architecture)).supports_quantization:
        raise QuantizationError(
            f"{architecture} does not support quantization (its class does not declare SupportsQuant), so no "
            f"{quantization} checkpoint of it can be loaded; write it unquantized (without --quantization).")
    quant_config = method(is_checkpoint_serialized=True)
    path = make_checkpoint(architecture, path, seed=seed, dtype=dtype, overrides=overrides, num_shards=num_shards,
                           registry=registry)
    config = json.loads((path / "config.json").read_text())
    scales = {name: shape for name, shape in expected_tensors(config, architecture, registry, quant_config).items()
              if name.endswith(SCALE_SUFFIX)}
    weight_map: dict[str, str] = {}
    with tensor_parallel_state(0, 1):
        for weights_file in sorted(path.glob("*.safetensors")):
            tensors = load_file(str(weights_file))
            for name, scale_shape in scales.items():
                weight_name = name.removesuffix(SCALE_SUFFIX)
                if weight_name not in tensors:
                    continue
                weight = tensors[weight_name]
                groups = [weight.shape[0]]
                scale = quant_config.compute_scale(weight, groups, input_sharded=False)
                tensors[weight_name] = quant_config.quantize(weight, scale, groups)
                tensors[name] = scale.reshape(scale_shape)
            save_file(tensors, str(weights_file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, weights_file.name))
    config["quantization_config"] = quant_config.to_hf_config()
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index = path / SAFETENSORS_INDEX
    if index.exists():
        total = sum(t.numel() * t.element_size()
                    for f in path.glob("*.safetensors") for t in load_file(str(f)).values())
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return path


def make_dequantized_checkpoint(quantized: str | Path, path: str | Path) -> Path:
    """Write the unquantized twin of a pre-quantized checkpoint into ``path``; return it: each 8-bit weight
    replaced by ``deq(W) = (weight * weight_scale).to(dtype)``, its scale dropped, ``quantization_config``
    removed from config.json.

    ``dtype`` is the one the engine resolves for ``quantized`` (config.json's), which is the dtype a weight-only
    method dequantizes into before its matmul (``ScaledQuantizationConfig.dequantize``, in the same float32
    arithmetic): the unquantized engine on this checkpoint multiplies by exactly the weights a correct quantized
    engine multiplies by.
    """
    from engine_ref.config import ModelConfig

    quantized, path = Path(quantized), Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = ModelConfig(str(quantized)).torch_dtype
    config = json.loads((quantized / "config.json").read_text())
    if "quantization_config" not in config:
        raise QuantizationError(f"{quantized} has no quantization_config in config.json: it is not quantized.")
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weight_map: dict[str, str] = {}
    for weights_file in sorted(quantized.glob("*.safetensors")):
        tensors = load_file(str(weights_file))
        for name in [n for n in tensors if n.endswith(SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX) in tensors]:
            scale, weight_name = tensors.pop(name), name.removesuffix(SCALE_SUFFIX)
            tensors[weight_name] = (tensors[weight_name].float() * scale.float()).to(dtype)
        save_file(tensors, str(path / weights_file.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, weights_file.name))
    if (quantized / SAFETENSORS_INDEX).exists():
        total = sum(t.numel() * t.element_size()
                    for f in path.glob("*.safetensors") for t in load_file(str(f)).values())
        (path / SAFETENSORS_INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return path
