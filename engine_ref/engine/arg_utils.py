"""EngineArgs: the flat arguments of LLM(...) and the CLI, turned into a validated EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_ref.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine_ref.errors import ConfigError

if TYPE_CHECKING:
    from engine_ref.model_executor.models.registry import _ModelRegistry


@dataclass
class EngineArgs:
    """The flat arguments of LLM(...) and the CLI; ``create_engine_config()`` validates them."""

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    ready_timeout_s: float | None = None
    rpc_timeout_s: float | None = None
    collective_timeout_s: float | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    load_format: str = "safetensors"
    device: str = "cpu"
    device_memory: str | int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64

    def create_engine_config(self, registry: _ModelRegistry | None = None,
                             inspect_in_subprocess: bool = True) -> EngineConfig:
        """Validate every field, resolve the architecture through the registry, return EngineConfig.

        The model class is inspected in a subprocess (the registry's cached inspection), or in this
        process with ``inspect_in_subprocess=False`` when the caller imports the model anyway. An
        architecture the registry does not know raises its UnknownArchitectureError.
        """
        from engine_ref.model_executor.models.interfaces import ModelInfo
        from engine_ref.model_executor.models.registry import ModelRegistry

        registry = registry or ModelRegistry
        config = EngineConfig(
            model_config=ModelConfig(
                model=self.model, dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                ready_timeout_s=self.ready_timeout_s,
                rpc_timeout_s=self.rpc_timeout_s, collective_timeout_s=self.collective_timeout_s,
            ),
            cache_config=CacheConfig(
                block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            load_config=LoadConfig(load_format=self.load_format),
            device_config=DeviceConfig(device=self.device, device_memory=self.device_memory),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            ),
        )
        arch = config.model_config.architecture
        if inspect_in_subprocess:
            info = registry.inspect_model_cls(arch)
        else:
            info = ModelInfo.from_model_cls(arch, registry.resolve_model_cls(arch))
        if config.parallel_config.tensor_parallel_size > 1 and not info.supports_tp:
            raise ConfigError(f"{arch} does not support tensor parallelism; use tensor_parallel_size=1.")
        config.model_info = info
        return config
