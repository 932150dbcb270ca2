"""EngineCore: engine startup in five timed phases, then the step loop.

    1 plugins   load_general_plugins()
    2 config    EngineArgs -> EngineConfig (validated; architecture resolved and inspected)
    3 executor  workers started: init_worker -> init_device -> load_model
    4 kv_cache  profile run on every rank -> min available memory -> num_blocks -> allocate
    5 ready     the StartupReport
"""

from __future__ import annotations

from engine_ref.config import EngineArgs, EngineConfig
from engine_ref.engine.report import PhaseTimer, StartupReport
from engine_ref.engine.scheduler import Request, Scheduler
from engine_ref.errors import KVCacheTooSmallError
from engine_ref.executor.abstract import Executor
from engine_ref.kv_cache.block_pool import BlockPool
from engine_ref.kv_cache.spec import check_enough_kv_cache_memory, get_num_blocks
from engine_ref.plugins import load_general_plugins
from engine_ref.utils import format_bytes


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
        if available <= 0 and cache.num_gpu_blocks_override is None:
            rank = per_rank.index(available)
            memory = self.executor.worker_reports()[rank].memory
            raise KVCacheTooSmallError(
                f"No memory is left for the KV cache on rank {rank}: weights ({format_bytes(memory.weights)}) "
                f"and the profile run's activation peak ({format_bytes(memory.activation_peak)}) exceed "
                f"{cache.gpu_memory_utilization} x {format_bytes(memory.capacity)} of device memory. Raise the "
                f"device memory or gpu_memory_utilization, lower max_num_batched_tokens (the profile run's "
                f"size), or raise tensor_parallel_size."
            )
        specs = self.executor.get_kv_cache_specs()[0]
        num_blocks = cache.num_gpu_blocks_override or get_num_blocks(specs, available)
        check_enough_kv_cache_memory(specs, num_blocks, cache.block_size,
                                     self.config.model_config.max_model_len, available)
        self.executor.initialize_cache(num_blocks)
        return num_blocks

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
