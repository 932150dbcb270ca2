"""LoRAModelManager: the LoRA slots of one rank's model (vLLM's manager, reduced to what startup needs).

Right after ``load_model`` the manager wraps every module LoRA can run on in its ``...WithLoRA``
layer and preallocates ``max_loras`` slots of ``max_lora_rank``. Adapters are read when first
requested (each rank its own slices), kept on the CPU up to ``max_cpu_loras`` (least recently
used evicted first) and copied into a slot when a batch needs them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from engine_ref.errors import ConfigError, InputError
from engine_ref.lora.config import LoRAConfig
from engine_ref.lora.layers import BaseLinearLayerWithLoRA, LoRAMapping, lora_layer_cls
from engine_ref.lora.lora_model import LoRAModel
from engine_ref.lora.peft_helper import PEFTHelper
from engine_ref.lora.request import LoRARequest
from engine_ref.lora.utils import lora_targets
from engine_ref.memory.accounting import storage_bytes
from engine_ref.model_executor.layers.linear import LinearBase
from engine_ref.model_executor.model_loader.weight_utils import LoadStats


class LoRAModelManager:
    """Wraps ``model``'s LoRA-capable layers (in place) and owns their slots and the loaded adapters.

    ``base_model`` is the engine's model (its ``model`` path), which an adapter's
    ``base_model_name_or_path`` must name; the slots are in ``lora_config``'s dtype ("auto": the
    model's ``model_dtype``). ``stats`` counts the adapter bytes this rank read.
    """

    def __init__(self, model: nn.Module, lora_config: LoRAConfig, base_model: str, model_dtype: torch.dtype
                 ) -> None:
        self.model, self.lora_config, self.base_model = model, lora_config, base_model
        self.targets = lora_targets(model)
        if not self.targets:
            raise ConfigError(f"{type(model).__name__} has no layer LoRA can wrap; start it without enable_lora.")
        self.dtype = lora_config.torch_dtype(model_dtype)
        self.device = next(model.parameters()).device
        self.mapping = LoRAMapping()
        self.modules: dict[str, BaseLinearLayerWithLoRA] = {}
        for name in sorted({module for module, _ in self.targets.values()}):
            base = model.get_submodule(name)
            # the targets name only layers lora_layer_cls wraps
            wrapper_cls = cast(type[BaseLinearLayerWithLoRA], lora_layer_cls(base))
            wrapper = wrapper_cls(cast(LinearBase, base), lora_config.max_loras, lora_config.max_lora_rank, self.dtype,
                                           self.device, self.mapping)
            model.set_submodule(name, wrapper)
            self.modules[name] = wrapper
        self.stats = LoadStats()
        self._cpu_loras: OrderedDict[int, LoRAModel] = OrderedDict()  # least recently used first
        self._slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first

    @property
    def lora_slot_bytes(self) -> int:
        """Bytes of the preallocated slots on this rank (A and B of every wrapped layer)."""
        return storage_bytes(t for m in self.modules.values() for t in (m.lora_a_stacked, m.lora_b_stacked))

    def add_adapter(self, request: LoRARequest) -> LoRAModel:
        """The adapter, read now if it is not loaded yet (evicting the least recently used one)."""
        lora = self._cpu_loras.get(request.lora_int_id)
        if lora is not None:
            if lora.lora_path != str(request.lora_path):
                raise InputError(
                    f"lora_int_id={request.lora_int_id} of {request.lora_name!r} ({request.lora_path}) is already "
                    f"the id of the adapter at {lora.lora_path}; give each adapter its own lora_int_id.")
            self._cpu_loras.move_to_end(request.lora_int_id)
            return lora
        peft_helper = PEFTHelper.from_local_dir(request.lora_path)
        peft_helper.validate_legal(self.lora_config, self.base_model, self.targets)
        lora = LoRAModel.from_local_checkpoint(request.lora_int_id, peft_helper, self.targets, self.modules,
                                               self.dtype, self.stats)
        self._cpu_loras[request.lora_int_id] = lora
        while len(self._cpu_loras) > (self.lora_config.max_cpu_loras or self.lora_config.max_loras):
            evicted, _ = self._cpu_loras.popitem(last=False)
            self._deactivate(evicted)
        return lora

    def set_active_adapters(self, lora_requests: Sequence[LoRARequest | None], num_tokens: Sequence[int]) -> None:
        """Prepare a batch: sequence i has ``num_tokens[i]`` tokens and runs with ``lora_requests[i]``.

        Loads and activates the adapters the batch needs, then points every wrapped layer at their slots.
        """
        used = list(dict.fromkeys(r.lora_int_id for r in lora_requests if r is not None))
        if len(used) > self.lora_config.max_loras:
            raise InputError(
                f"this batch uses {len(used)} adapters but max_loras={self.lora_config.max_loras}; raise max_loras "
                f"to {len(used)} (--max-loras {len(used)}) or send fewer adapters per batch.")
        slots = {}
        for request in lora_requests:
            if request is not None and request.lora_int_id not in slots:
                slots[request.lora_int_id] = self._activate(self.add_adapter(request), pinned=set(used))
        token_slots = [slots[r.lora_int_id] if r is not None else -1
                       for r, n in zip(lora_requests, num_tokens, strict=True) for _ in range(n)]
        self.mapping.set(torch.tensor(token_slots, dtype=torch.long, device=self.device))

    def set_dummy_adapters(self, num_tokens: Sequence[int]) -> None:
        """The profile run's batch (vLLM's dummy LoRAs): sequence i runs on slot ``i % max_loras``, whatever
        the slots hold, so every LoRA product of a full batch is in the activation peak."""
        max_loras = self.lora_config.max_loras
        token_slots = [i % max_loras for i, n in enumerate(num_tokens) for _ in range(n)]
        self.mapping.set(torch.tensor(token_slots, dtype=torch.long, device=self.device))

    def _activate(self, lora: LoRAModel, pinned: set[int]) -> int:
        """The slot holding ``lora``, filled now if needed (in a free slot, or the least recently used one)."""
        if lora.id in self._slots:
            self._slots.move_to_end(lora.id)
            return self._slots[lora.id]
        free = sorted(set(range(self.lora_config.max_loras)) - set(self._slots.values()))
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self._slots if i not in pinned)
            slot = self._slots.pop(victim)
        for name, module in self.modules.items():
            module.set_lora(slot, lora.loras.get(name, {}))
        self._slots[lora.id] = slot
        return slot

    def _deactivate(self, lora_int_id: int) -> None:
        slot = self._slots.pop(lora_int_id, None)
        if slot is not None:
            for module in self.modules.values():
                module.reset_lora(slot)
