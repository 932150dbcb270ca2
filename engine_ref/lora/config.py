"""LoRAConfig: the LoRA slots an engine reserves at startup (vLLM's names). Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_ref.config.model import DTYPES
from engine_ref.errors import ConfigError

if TYPE_CHECKING:
    import torch


def _at_least_one(name: str, flag: str, value: object, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an integer of at least 1 ({meaning}); "
                          f"pass {name}=1 ({flag} 1) or more.")


@dataclass
class LoRAConfig:
    """``max_loras`` slots of rank up to ``max_lora_rank`` on every rank; ``max_cpu_loras`` adapters
    kept loaded on the CPU (least recently used evicted first; default ``max_loras``)."""

    max_lora_rank: int = 16
    max_loras: int = 1
    lora_dtype: str = "auto"
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _at_least_one("max_loras", "--max-loras", self.max_loras,
                      "the adapters one batch can use, each in its own slot")
        _at_least_one("max_lora_rank", "--max-lora-rank", self.max_lora_rank,
                      "the largest adapter rank r a slot holds")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _at_least_one("max_cpu_loras", "--max-cpu-loras", self.max_cpu_loras, "adapters kept loaded on the CPU")
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"max_cpu_loras={self.max_cpu_loras} is smaller than max_loras={self.max_loras}, but every adapter "
                f"in a slot is also kept on the CPU; raise max_cpu_loras to at least {self.max_loras} or leave it "
                f"unset (it defaults to max_loras)."
            )
        requested = str(self.lora_dtype).removeprefix("torch.")
        if requested != "auto" and requested not in DTYPES:
            raise ConfigError(f"lora_dtype={self.lora_dtype!r} is not supported; use auto (the model's dtype), "
                              f"float32, float16 or bfloat16.")
        self.lora_dtype = requested if requested == "auto" else DTYPES[requested]

    def torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The slots' dtype: ``lora_dtype``, or the model's for "auto"."""
        import torch

        return model_dtype if self.lora_dtype == "auto" else getattr(torch, self.lora_dtype)
