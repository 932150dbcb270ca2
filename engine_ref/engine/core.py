"""EngineCore: engine startup in five timed phases, then the step loop.

    1 plugins   load_general_plugins()
    2 config    EngineArgs -> EngineConfig (validated; architecture resolved and inspected)
    3 executor  workers started: init_worker -> init_device -> load_model
    4 kv_cache  profile run on every rank -> min available memory -> num_blocks -> allocate
    5 ready     the StartupReport
"""

from __future__ import annotations

from engine_ref.config import EngineConfig
from engine_ref.engine.arg_utils import EngineArgs
from engine_ref.engine.report import PhaseTimer, StartupReport
from engine_ref.engine.scheduler import Request, Scheduler
from engine_ref.errors import KVCacheTooSmallError, MemoryShortfall
from engine_ref.executor.abstract import Executor
from engine_ref.kv_cache.block_pool import BlockPool
from engine_ref.kv_cache.spec import (
    FullAttentionSpec,
    bytes_per_block,
    check_enough_kv_cache_memory,
    get_num_blocks,
)
from engine_ref.plugins import load_general_plugins
from engine_ref.utils import cdiv, format_bytes


class EngineCore:
    """A started engine: its config, executor, scheduler and StartupReport."""

    def __init__(self, args: EngineArgs) -> None:
        timer = PhaseTimer()
        with timer.phase("plugins"):
            load_general_plugins()
        with timer.phase("config"):
            self.config: EngineConfig = args.create_engine_config()
        with timer.phase("executor"):
            self.executor = Executor.get_class(self.config)(self.config)
        try:
            with timer.phase("kv_cache"):
                num_blocks = self._initialize_kv_caches()
            with timer.phase("ready"):
                self.scheduler = Scheduler(
                    BlockPool(num_blocks, self.config.cache_config.block_size),
                    self.config.scheduler_config.max_num_batched_tokens,
                    self.config.scheduler_config.max_num_seqs,
                    self.config.model_config.max_model_len,
                )
                workers = self.executor.worker_reports()
        except BaseException:
            self.executor.shutdown()
            raise
        model = self.config.model_config
        self.startup_report = StartupReport(
            architecture=model.architecture, model=model.model,
            tensor_parallel_size=self.config.parallel_config.tensor_parallel_size,
            executor_backend=self.config.parallel_config.distributed_executor_backend,
            max_model_len=model.max_model_len, block_size=self.config.cache_config.block_size,
            num_gpu_blocks=num_blocks, phases=timer.seconds, workers=workers,
        )

    def _initialize_kv_caches(self) -> int:
        """Size the KV cache from the most constrained rank and allocate it on every rank."""
        per_rank = self.executor.determine_available_memory()
        available = min(per_rank)
        cache = self.config.cache_config
        specs = self.executor.get_kv_cache_specs()[0]
        if available <= 0 and cache.num_gpu_blocks_override is None:
            shortfall = self._shortfall(per_rank, specs)
            raise KVCacheTooSmallError(
                f"No memory is left for the KV cache on rank {shortfall.rank}: weights "
                f"({format_bytes(shortfall.weights)}) and the profile run's activation peak "
                f"({format_bytes(shortfall.activation_peak)}) exceed {cache.gpu_memory_utilization} x "
                f"{format_bytes(shortfall.capacity)} of device memory. Raise the device memory or "
                f"gpu_memory_utilization, lower max_num_batched_tokens (the profile run's size), or raise "
                f"tensor_parallel_size.", shortfall)
        num_blocks = cache.num_gpu_blocks_override or get_num_blocks(specs, available)
        try:
            check_enough_kv_cache_memory(specs, num_blocks, cache.block_size,
                                         self.config.model_config.max_model_len, available)
        except KVCacheTooSmallError as e:
            raise KVCacheTooSmallError(str(e), self._shortfall(per_rank, specs)) from None
        self.executor.initialize_cache(num_blocks)
        return num_blocks

    def _shortfall(self, per_rank: list[int], specs: dict[str, FullAttentionSpec]) -> MemoryShortfall:
        """What the most constrained rank needs: its weights, activation peak, KV of one request."""
        rank = per_rank.index(min(per_rank))
        memory = self.executor.worker_reports()[rank].memory
        kv = cdiv(self.config.model_config.max_model_len, self.config.cache_config.block_size) * bytes_per_block(specs)
        return MemoryShortfall(rank, memory.weights, memory.activation_peak, kv, memory.capacity)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def step(self) -> list[Request]:
        """Run one scheduled batch on the workers; return the requests it finished."""
        output = self.scheduler.schedule()
        if not output.seqs:
            return []
        sampled = self.executor.execute_model(output)
        return self.scheduler.update_from_output(output, sampled)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def shutdown(self) -> None:
        """Stop the workers. Idempotent."""
        self.executor.shutdown()
