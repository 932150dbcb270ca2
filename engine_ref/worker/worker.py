"""Worker: one rank of the engine, from device set-up to a bound KV cache.

The executor drives every worker through the same calls, in order:
    Worker(...)  (init_worker)  ->  init_device  ->  load_model
    ->  determine_available_memory  ->  initialize_cache(num_blocks)  ->  execute_model ...
Memory is accounted exactly per category; on CPU the device capacity is the configured
(simulated) device_memory, on CUDA the GPU's own (or device_memory, if set, to emulate a smaller one).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from engine_ref.config import EngineConfig
from engine_ref.distributed.parallel_state import destroy_distributed_environment, init_distributed_environment
from engine_ref.engine.report import PhaseTimer, Span, WorkerReport
from engine_ref.engine.scheduler import SchedulerOutput
from engine_ref.errors import ConfigError
from engine_ref.kv_cache.sizing import size_kv_cache
from engine_ref.kv_cache.spec import FullAttentionSpec, bytes_per_block
from engine_ref.lora.models import LoRAModelManager
from engine_ref.lora.request import LoRARequest
from engine_ref.memory.accounting import MemoryUsage, module_bytes, storage_bytes
from engine_ref.memory.workload import StepMemoryTracker
from engine_ref.model_executor.layers.attention import Attention
from engine_ref.model_executor.model_loader.loaders import get_model_loader
from engine_ref.plugins import load_general_plugins
from engine_ref.worker.cuda_guard import worker_cuda_guard
from engine_ref.worker.model_runner import ModelRunner


class Worker:
    """One rank of the engine (a process of its own under the multiprocess executor)."""

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None) -> None:
        load_general_plugins()
        self.config, self.rank = config, rank
        self.distributed_init_method = distributed_init_method
        self.timer = PhaseTimer()
        self.device = torch.device("cpu")
        self.memory = MemoryUsage(capacity=0)
        self.bytes_read = 0
        self.file_reads: list[Span] = []  # the startup trace's slices inside load_model
        self.model: nn.Module | None = None
        self.lora_manager: LoRAModelManager | None = None
        self.model_runner: ModelRunner | None = None
        self.step_memory: StepMemoryTracker | None = None  # on after track_step_memory()
        self.cuda_guard = worker_cuda_guard(config, rank)  # None unless ENGINE_REF_CUDA_GUARD asks for one

    def _guarded(self, phase: str) -> AbstractContextManager[None]:
        """The CUDA guard around a build or a forward (engine_ref.worker.cuda_guard), when there is one."""
        return self.cuda_guard.phase(phase) if self.cuda_guard is not None else nullcontext()

    @property
    def world_size(self) -> int:
        return self.config.parallel_config.world_size

    def init_device(self) -> None:
        """Pick the device, join the engine's process group (gloo on CPU, nccl on CUDA), seed."""
        with self.timer.phase("init_device"):
            device_config = self.config.device_config
            if device_config.device == "cuda":
                if not torch.cuda.is_available():
                    raise ConfigError("device='cuda' but no CUDA device is visible to this worker; use device='cpu'.")
                self.device = torch.device("cuda", self.rank % torch.cuda.device_count())
                torch.cuda.set_device(self.device)
                backend = "nccl"
            else:
                backend = "gloo"
                if self.world_size > 1:  # ranks share the cores instead of each taking all of them
                    torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
            capacity = device_config.capacity_bytes  # always set on CPU (DeviceConfig's default)
            if capacity is None:  # CUDA without device_memory: the GPU's own
                capacity = torch.cuda.mem_get_info(self.device)[1]
            self.memory = MemoryUsage(capacity=capacity)
            if self.world_size > 1 and self.distributed_init_method is None:
                raise ValueError("a worker of a multi-rank engine needs a distributed_init_method")
            parallel = self.config.parallel_config
            init_distributed_environment(self.world_size, self.rank, self.distributed_init_method or "", backend,
                                         timeout_s=parallel.ready_timeout_s,
                                         collective_timeout_s=parallel.collective_timeout_s)
            torch.manual_seed(self.config.model_config.seed)

    def load_model(self) -> None:
        """Build this rank's shard of the model and load its weights; with LoRA, wrap its target layers and
        preallocate the adapter slots (counted as ``lora``, apart from the model's buffers)."""
        with self.timer.phase("load_model"), self._guarded("load_model"):
            loader = get_model_loader(self.config.load_config)
            self.model = loader.load_model(self.config, self.device)
            self.bytes_read = loader.stats.bytes_read
            self.file_reads = [Span(f"read {name}", int(first), int(last), {"read_s": round(secs, 6), "bytes": nbytes})
                               for name, (first, last, secs, nbytes) in loader.stats.files.items()]
            self.memory.weights, self.memory.buffers = module_bytes(self.model)
            if self.config.lora_config is not None:
                model_config = self.config.model_config
                self.lora_manager = LoRAModelManager(self.model, self.config.lora_config, model_config.model,
                                                     model_config.torch_dtype)
                self.memory.lora = self.lora_manager.lora_slot_bytes
            self.model_runner = ModelRunner(self.model, self.config, self.device, self.lora_manager)

    def _loaded(self) -> ModelRunner:
        """The model runner ``load_model`` built (it holds the model); before it, or after shutdown, none."""
        if self.model_runner is None:
            raise RuntimeError("the worker has no model: call load_model() first (and not after shutdown)")
        return self.model_runner

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter into this rank's CPU cache now (vLLM's add_lora): its errors come before any request
        runs with it."""
        if self.lora_manager is None:
            raise ValueError("add_lora on a worker started without enable_lora")
        self.lora_manager.add_adapter(lora_request)
        return True

    def determine_available_memory(self) -> int:
        """Run the profile; return the bytes this rank has left for the KV cache (kv_cache/sizing.py)."""
        with self.timer.phase("profile_run"), self._guarded("profile_run"):
            self.memory.activation_peak = self._loaded().profile_run()
        cache = self.config.cache_config
        sizing = size_kv_cache([self.memory], gpu_memory_utilization=cache.gpu_memory_utilization,
                               bytes_per_block=bytes_per_block(self.get_kv_cache_spec()),
                               block_size=cache.block_size, max_model_len=self.config.model_config.max_model_len)
        return sizing.available_bytes[0]

    def attention_layers(self) -> dict[str, Attention]:
        return {name: m for name, m in self._loaded().model.named_modules() if isinstance(m, Attention)}

    def get_kv_cache_spec(self) -> dict[str, FullAttentionSpec]:
        dtype_bytes = self.config.model_config.torch_dtype.itemsize
        block_size = self.config.cache_config.block_size
        return {name: FullAttentionSpec(block_size, attn.num_kv_heads, attn.head_size, dtype_bytes)
                for name, attn in self.attention_layers().items()}

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks in every attention layer and bind them."""
        with self.timer.phase("initialize_cache"):
            block_size = self.config.cache_config.block_size
            dtype = self.config.model_config.torch_dtype
            caches = []
            for attn in self.attention_layers().values():
                attn.kv_cache = torch.empty(2, num_blocks, block_size, attn.num_kv_heads, attn.head_size,
                                            dtype=dtype, device=self.device)
                caches.append(attn.kv_cache)
            self.memory.kv_cache = storage_bytes(caches)

    def execute_model(self, scheduler_output: SchedulerOutput) -> list[int]:
        runner = self._loaded()
        with self._guarded("execute_model"):
            if self.step_memory is not None:
                return self.step_memory.step(scheduler_output.phase, lambda: runner.execute_model(scheduler_output))
            return runner.execute_model(scheduler_output)

    def track_step_memory(self) -> None:
        """From now on, measure the memory of every step (per phase: prefill, decode) and what the steps keep
        allocated between steps: ``report().workload``. Call it after ``initialize_cache``."""
        model = self._loaded().model
        caches = [attn.kv_cache for attn in self.attention_layers().values() if attn.kv_cache is not None]
        self.step_memory = StepMemoryTracker(self.device, [*model.parameters(), *model.buffers(), *caches])

    def report(self) -> WorkerReport:
        return WorkerReport(rank=self.rank, pid=os.getpid(), device=str(self.device),
                            phases=dict(self.timer.seconds), bytes_read=self.bytes_read, memory=self.memory,
                            spans=[*self.timer.spans, *self.file_reads],
                            workload=None if self.step_memory is None else self.step_memory.report())

    def shutdown(self) -> None:
        self.model = self.model_runner = self.lora_manager = self.step_memory = None
        destroy_distributed_environment()
