"""The exceptions engine_ref raises. Each message says what was wrong and what to change."""

from __future__ import annotations

from dataclasses import dataclass


class EngineRefError(Exception):
    """Base class of every error engine_ref raises on purpose."""


class ConfigError(EngineRefError, ValueError):
    """An engine setting or a model's config.json is invalid."""


class MissingConfigField(ConfigError, AttributeError):
    """config.json lacks a field the model needs (also an AttributeError, so getattr defaults work)."""


class UnknownArchitectureError(ConfigError):
    """An architecture name that no registry entry matches."""


class QuantizationError(ConfigError):
    """A quantization method this torch build, architecture or layer cannot use, or a config it rejects."""


class ModelInspectionError(EngineRefError):
    """Inspecting a model class in a subprocess failed; carries the child's own traceback."""


class WeightLoadError(EngineRefError):
    """A checkpoint is incomplete, has unexpected or mis-shaped tensors, or is corrupt."""


class KVCacheTooSmallError(EngineRefError):
    """The memory left for the KV cache cannot hold one request of max_model_len tokens.

    ``shortfall`` (when the engine knows it) says what the most constrained rank needed.
    """

    def __init__(self, message: str, shortfall: MemoryShortfall | None = None) -> None:
        super().__init__(message)
        self.shortfall = shortfall


@dataclass(frozen=True)
class MemoryShortfall:
    """One rank's needs: weights, buffers, LoRA slots, activation peak, KV of one request of max_model_len."""

    rank: int
    weights: int
    buffers: int
    activation_peak: int
    kv_cache: int
    capacity: int
    lora: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.buffers + self.lora + self.activation_peak + self.kv_cache


class WorkerStartupError(EngineRefError):
    """A worker failed, died or hung while the engine started."""


class EngineDeadError(EngineRefError):
    """The engine's workers are gone; the engine must be started again."""


class InputError(EngineRefError, ValueError):
    """A request the engine cannot serve (too long, empty, out-of-vocabulary tokens)."""
