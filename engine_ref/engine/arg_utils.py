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
from engine_ref.errors import ConfigError, QuantizationError
from engine_ref.lora.config import LoRAConfig

if TYPE_CHECKING:
    from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig
    from engine_ref.model_executor.models.interfaces import ModelInfo
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
    quantization: str | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"

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
        model_config = ModelConfig(
            model=self.model, dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed,
            quantization=self.quantization,
        )
        config = EngineConfig(
            model_config=model_config,
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
                max_model_len=model_config.max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
            ),
            lora_config=self._create_lora_config(),
        )
        arch = config.model_config.architecture
        if inspect_in_subprocess:
            info = registry.inspect_model_cls(arch)
        else:
            info = ModelInfo.from_model_cls(arch, registry.resolve_model_cls(arch))
        if config.parallel_config.tensor_parallel_size > 1 and not info.supports_tp:
            raise ConfigError(f"{arch} does not support tensor parallelism; use tensor_parallel_size=1.")
        if config.lora_config is not None and not info.supports_lora:
            raise ConfigError(
                f"enable_lora=True, but {arch} does not support LoRA (its class does not declare SupportsLoRA); "
                f"start it without enable_lora (--enable-lora), or use an architecture that supports LoRA.")
        config.quant_config = self._create_quant_config(config.model_config, info)
        config.model_info = info
        return config

    def _create_lora_config(self) -> LoRAConfig | None:
        if not isinstance(self.enable_lora, bool):
            raise ConfigError(f"enable_lora={self.enable_lora!r} must be True or False.")
        if not self.enable_lora:
            return None
        return LoRAConfig(max_lora_rank=self.max_lora_rank, max_loras=self.max_loras,
                          lora_dtype=self.lora_dtype, max_cpu_loras=self.max_cpu_loras)

    def _create_quant_config(self, model_config: ModelConfig, info: ModelInfo) -> QuantizationConfig | None:
        """The checkpoint's quantization (config.json's quantization_config), else ``quantization=``'s
        (converting at startup), if the architecture supports it; ``model_config.quantization`` becomes
        the method in use."""
        from engine_ref.model_executor.layers.quantization import get_quant_config

        quant_config = get_quant_config(self.quantization, model_config.hf_config.get("quantization_config"))
        if quant_config is None:
            return None
        if not info.supports_quantization:
            asked = (f"quantization={self.quantization!r} was asked for" if self.quantization is not None else
                     f"{model_config.model}/config.json says its weights are quantized ({quant_config.get_name()})")
            raise QuantizationError(
                f"{asked}, but {info.architecture} does not support quantization (its class does not declare "
                f"SupportsQuant); start it without quantization (--quantization), from an unquantized checkpoint.")
        model_config.quantization = quant_config.get_name()
        return quant_config
