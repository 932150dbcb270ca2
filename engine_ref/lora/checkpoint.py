"""Write a tiny random PEFT adapter for a checkpoint (``engine-ref make-lora``), with a fixed seed.

The files are PEFT's: ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's
tensor names, for every module of the model LoRA can run on (or ``target_modules``). B is
random, not PEFT's zeros, so the adapter changes the model's output.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine_ref.config import HFConfig
from engine_ref.distributed.parallel_state import tensor_parallel_state
from engine_ref.errors import ConfigError
from engine_ref.lora.peft_helper import ADAPTER_CONFIG, ADAPTER_WEIGHTS, short_module_names
from engine_ref.lora.utils import lora_targets
from engine_ref.model_executor.models.registry import ModelRegistry, _ModelRegistry


def make_lora(base_model: str | Path, path: str | Path, *, r: int = 4, lora_alpha: float = 8.0,
              target_modules: Sequence[str] | None = None, seed: int = 0,
              registry: _ModelRegistry = ModelRegistry) -> Path:
    """Write a random rank-``r`` adapter for the checkpoint ``base_model`` into ``path``; return ``path``."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ConfigError(f"r={r!r} must be an integer of at least 1 (the adapter's rank); pass r=4, for example.")
    config = HFConfig.from_file(Path(base_model) / "config.json")
    with tensor_parallel_state(0, 1), torch.device("meta"):
        model = registry.resolve_model_cls(config.architectures[0])(config)
    targets = lora_targets(model)
    supported = short_module_names(targets)
    names = list(target_modules or supported)
    unknown = sorted(set(names) - set(supported))
    if unknown:
        raise ConfigError(f"target_modules {unknown} are not modules {config.architectures[0]} runs LoRA on; "
                          f"use some of {supported}.")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for peft_module, (module_name, shard_id) in sorted(targets.items()):
        if peft_module.rsplit(".", 1)[-1] in names:
            layer = model.get_submodule(module_name)
            out_size, in_size = layer.output_shards[shard_id], layer.input_size
            prefix = f"base_model.model.{peft_module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, in_size, generator=generator) / math.sqrt(in_size)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_size, r, generator=generator) / math.sqrt(r)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
        "r": r, "lora_alpha": lora_alpha, "lora_dropout": 0.0, "target_modules": sorted(names),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "inference_mode": True, "init_lora_weights": True,
    }
    (path / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return path
