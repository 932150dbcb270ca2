"""CacheConfig: how the KV cache is sized."""

from __future__ import annotations

from dataclasses import dataclass

from engine_ref.config.utils import positive_int
from engine_ref.errors import ConfigError


@dataclass
class CacheConfig:
    """How the KV cache is sized: block size and the share of device memory the engine may use."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        positive_int("block_size", self.block_size)
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1], "
                f"the fraction of device memory the engine may use (e.g. 0.9)."
            )
        if self.num_gpu_blocks_override is not None:
            positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override)
