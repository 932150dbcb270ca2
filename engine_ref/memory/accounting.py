"""Exact memory by category, from tensor storage (CPU) or torch.cuda's statistics (CUDA)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from engine_ref.memory.tracker import ActivationTracker
from engine_ref.utils import format_bytes

T = TypeVar("T")


@dataclass
class MemoryUsage:
    """One rank's device memory by category, in bytes: ``weights`` are the parameters, ``buffers``
    the module buffers (rotary tables and the like) that are not also parameters, ``lora`` the
    preallocated LoRA adapter slots (0 without LoRA)."""

    capacity: int
    weights: int = 0
    buffers: int = 0
    lora: int = 0
    activation_peak: int = 0
    kv_cache: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.buffers + self.lora + self.activation_peak + self.kv_cache

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}

    def describe(self) -> str:
        return (f"{format_bytes(self.total)} (weights {format_bytes(self.weights)}, buffers "
                f"{format_bytes(self.buffers)}, LoRA {format_bytes(self.lora)}, activations "
                f"{format_bytes(self.activation_peak)}, KV cache {format_bytes(self.kv_cache)})")


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tied weight counts once)."""
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()  # one Python object per storage, so id() identifies it
        storages.setdefault(id(storage), storage)
    return sum(storage.nbytes() for storage in storages.values())


def module_bytes(module: nn.Module) -> tuple[int, int]:
    """(parameter bytes, buffer bytes) of a module; each storage counted once, a buffer sharing a
    parameter's storage as a parameter."""
    weights = storage_bytes(module.parameters())
    return weights, storage_bytes([*module.parameters(), *module.buffers()]) - weights


def measure_peak(fn: Callable[[], T], device: torch.device, existing: Any = ()) -> tuple[T, int]:
    """Run ``fn`` and return its result with the peak bytes it allocated on ``device``.

    CPU (and meta/fake tensors): exact, by ActivationTracker. CUDA: torch.cuda's peak statistics
    above the memory allocated before the call.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - before
    with ActivationTracker(existing) as tracker:
        result = fn()
    return result, tracker.peak_bytes
