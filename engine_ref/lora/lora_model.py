"""LoRAModel: one adapter's weights on this rank, read from PEFT's ``adapter_model.safetensors``.

PEFT names a module's tensors ``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and
``...lora_B.weight`` (``[out, r]``). Each rank reads only the slices its wrapped layers hold
(``safe_open(...).get_slice``), and B is scaled once here, so a forward is two matmuls.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from engine_ref.errors import ConfigError, WeightLoadError
from engine_ref.lora.layers import BaseLinearLayerWithLoRA
from engine_ref.lora.peft_helper import ADAPTER_WEIGHTS, PEFTHelper, short_module_names
from engine_ref.lora.utils import LoRATargets
from engine_ref.model_executor.model_loader.weight_utils import CheckpointTensor, LoadStats, ShardId

_PEFT_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


@dataclass
class LoRAModel:
    """An adapter, ready for a slot: per wrapped module, ``{sub-projection: (A, scaled B)}`` of this rank."""

    id: int
    rank: int
    lora_path: str
    loras: dict[str, dict[ShardId, tuple[torch.Tensor, torch.Tensor]]]

    @classmethod
    def from_local_checkpoint(cls, lora_int_id: int, peft_helper: PEFTHelper, targets: LoRATargets,
                              modules: dict[str, BaseLinearLayerWithLoRA], dtype: torch.dtype,
                              stats: LoadStats | None = None) -> LoRAModel:
        """Read this rank's slices of the adapter in ``peft_helper.path``; raise WeightLoadError for a
        missing, corrupt or mis-shaped file and ConfigError for a module the model cannot wrap."""
        path = peft_helper.path / ADAPTER_WEIGHTS
        if not path.is_file():
            bin_hint = " (it holds adapter_model.bin: save it again with safe_serialization=True)" \
                if (peft_helper.path / "adapter_model.bin").exists() else ""
            raise WeightLoadError(f"{peft_helper.path} has no {ADAPTER_WEIGHTS}{bin_hint}; engine_ref reads "
                                  f"adapters from safetensors files only.")
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise WeightLoadError(f"{path} is not a readable safetensors file ({e}); it is truncated or corrupt. "
                                  f"Save the adapter again.") from None
        pairs: dict[str, dict[str, CheckpointTensor]] = defaultdict(dict)
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle is not a dict
                match = _PEFT_NAME.match(name)
                if match is None:
                    raise WeightLoadError(
                        f"unexpected tensor {name!r} in {path}: PEFT names LoRA tensors "
                        f"base_model.model.<module>.lora_A.weight / .lora_B.weight; save the adapter with PEFT.")
                tensor_slice = f.get_slice(name)
                pairs[match["module"]][match["which"]] = CheckpointTensor(
                    name, tensor_slice, tensor_slice.get_shape(), path.name, stats)
            loras: dict[str, dict[ShardId, tuple[torch.Tensor, torch.Tensor]]] = defaultdict(dict)
            for peft_module, pair in sorted(pairs.items()):
                if peft_module not in targets:
                    raise ConfigError(
                        f"{path} holds LoRA weights for {peft_module!r}, a module this model cannot run LoRA on "
                        f"(it supports {short_module_names(targets)}); train the adapter on those modules only.")
                missing = sorted({"A", "B"} - set(pair))
                if missing:
                    raise WeightLoadError(f"{path} has no lora_{missing[0]} for {peft_module!r}; every LoRA module "
                                          f"needs lora_A and lora_B. The file is incomplete: save the adapter again.")
                module_name, shard_id = targets[peft_module]
                layer = modules[module_name]
                lora_a, lora_b = pair["A"], pair["B"]
                for tensor, shape in zip((lora_a, lora_b), layer.full_shapes(shard_id, peft_helper.r), strict=True):
                    if tuple(tensor.shape) != shape:
                        raise WeightLoadError(
                            f"LoRA tensor {tensor.name!r} in {path} has shape {list(tensor.shape)}, but "
                            f"{peft_module} of this model with r={peft_helper.r} needs {list(shape)}: the adapter "
                            f"was trained for another model (or another r); use an adapter for this model.")
                a = layer.slice_lora_a(lora_a).load().to(dtype)
                b = layer.slice_lora_b(lora_b, shard_id).load().to(dtype) * peft_helper.scaling
                loras[module_name][shard_id] = (a, b)
        return cls(lora_int_id, peft_helper.r, str(peft_helper.path), dict(loras))

