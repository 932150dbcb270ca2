"""EngineConfig: every sub-config an engine and its workers need, validated across them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_ref.config.cache import CacheConfig
from engine_ref.config.device import DeviceConfig
from engine_ref.config.load import LoadConfig
from engine_ref.config.model import DTYPE_BYTES, ModelConfig
from engine_ref.config.parallel import ParallelConfig, verify_tensor_parallel_size
from engine_ref.config.scheduler import SchedulerConfig
from engine_ref.errors import ConfigError
from engine_ref.utils import cdiv, format_bytes, host_memory_bytes

if TYPE_CHECKING:
    from engine_ref.lora.config import LoRAConfig
    from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig
    from engine_ref.model_executor.models.interfaces import ModelInfo


@dataclass
class EngineConfig:
    """Everything an engine and its workers need, validated across fields."""

    model_config: ModelConfig
    parallel_config: ParallelConfig
    cache_config: CacheConfig
    load_config: LoadConfig
    device_config: DeviceConfig
    scheduler_config: SchedulerConfig
    lora_config: LoRAConfig | None = None  # None: LoRA not enabled
    quant_config: QuantizationConfig | None = None  # None: unquantized weights
    model_info: ModelInfo | None = None

    def __post_init__(self) -> None:
        verify_tensor_parallel_size(self.model_config, self.parallel_config.tensor_parallel_size)
        if self.device_config.device == "cuda":
            import torch

            if not torch.backends.cuda.is_built():
                raise ConfigError(
                    f"device='cuda' but this torch build ({torch.__version__}) has no CUDA; use device='cpu'."
                )

    def verify_device_memory(self) -> None:
        """Before any worker starts: refuse sizes that cannot fit one rank's device, whatever the profile run finds.

        Each need is a lower bound of what a rank allocates (the embedding shard, the profile batch's
        hidden states, one max_model_len request's KV cache, an explicit block count), so a ConfigError
        here is certain, and comes in milliseconds rather than as a MemoryError from the workers.
        On CPU the simulated device memory must also exist in this host, which backs it.
        """
        capacity = self.device_config.capacity_bytes
        if capacity is None:  # CUDA without device_memory: the worker reads the GPU's own
            return
        if self.device_config.device == "cpu" and capacity > (host := host_memory_bytes()):
            raise ConfigError(
                f"device_memory={self.device_config.device_memory!r} ({format_bytes(capacity)}) exceeds this host's "
                f"memory ({format_bytes(host)}), which holds the simulated CPU device; lower device_memory "
                f"(--device-memory) to at most {format_bytes(host)}.")
        model, tp = self.model_config, self.parallel_config.tensor_parallel_size
        text, itemsize = model.hf_text_config, DTYPE_BYTES[model.dtype]
        block_size = self.cache_config.block_size
        block_bytes = (2 * block_size * max(1, model.num_key_value_heads // tp) * model.head_dim * itemsize
                       * model.num_hidden_layers)
        budget = int(capacity * self.cache_config.gpu_memory_utilization)
        tokens = self.scheduler_config.max_num_batched_tokens
        needs = [
            (cdiv(text.vocab_size, tp) * text.hidden_size * itemsize,
             f"config.json's vocab_size={text.vocab_size} x hidden_size={text.hidden_size} (the embedding, "
             f"{'split over' if tp > 1 else 'on'} {tp} rank(s))", "the model does not fit: raise tensor_parallel_size"),
            (tokens * text.hidden_size * itemsize,
             f"max_num_batched_tokens={tokens} (the profile run's batch) x hidden_size={text.hidden_size}",
             "lower max_num_batched_tokens and max_model_len"),
            (cdiv(model.max_model_len, block_size) * block_bytes,
             f"max_model_len={model.max_model_len} (one request's KV cache)",
             f"lower max_model_len to at most {budget // block_bytes * block_size}"),
        ]
        if self.cache_config.num_gpu_blocks_override is not None:
            blocks = self.cache_config.num_gpu_blocks_override
            needs.append((blocks * block_bytes, f"num_gpu_blocks_override={blocks} (KV blocks)",
                          f"lower num_gpu_blocks_override to at most {budget // block_bytes}"))
        for need, what, fix in needs:
            if need > budget:
                utilization = self.cache_config.gpu_memory_utilization
                raise ConfigError(
                    f"{what} needs {format_bytes(need)} per rank, more than the {utilization} x "
                    f"{format_bytes(capacity)} of device memory it may use; {fix}, or raise device_memory.")
