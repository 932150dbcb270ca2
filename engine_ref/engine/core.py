"""EngineCore: engine startup in five timed phases, then the step loop.

    1 plugins   load_general_plugins()
    2 config    EngineArgs -> EngineConfig (validated; architecture resolved and inspected)
    3 executor  workers started: init_worker -> init_device -> load_model
    4 kv_cache  profile run on every rank -> min available memory -> num_blocks -> allocate
    5 ready     the StartupReport
"""

from __future__ import annotations

import os

from engine_ref import envs
from engine_ref.config import EngineConfig
from engine_ref.engine.arg_utils import EngineArgs
from engine_ref.engine.report import PhaseTimer, StartupReport
from engine_ref.engine.scheduler import Request, Scheduler
from engine_ref.executor.abstract import Executor
from engine_ref.executor.shutdown import WorkerExit
from engine_ref.kv_cache.block_pool import BlockPool
from engine_ref.kv_cache.sizing import KVCacheSizing, check_enough_kv_cache_memory, size_kv_cache
from engine_ref.kv_cache.spec import bytes_per_block
from engine_ref.lora.request import LoRARequest
from engine_ref.plugins import load_general_plugins


class EngineCore:
    """A started engine: its config, executor, scheduler and StartupReport."""

    def __init__(self, args: EngineArgs) -> None:
        timer = PhaseTimer()
        with timer.phase("plugins"):
            load_general_plugins()
        with timer.phase("config"):
            self.config: EngineConfig = args.create_engine_config()
            self.config.verify_device_memory()
        with timer.phase("executor"):
            self.executor = Executor.get_class(self.config)(self.config)
        try:
            with timer.phase("kv_cache"):
                kv_cache = self._initialize_kv_caches()
            with timer.phase("ready"):
                self.scheduler = Scheduler(
                    BlockPool(kv_cache.num_blocks, self.config.cache_config.block_size),
                    self.config.scheduler_config.max_num_batched_tokens,
                    self.config.scheduler_config.max_num_seqs,
                    self.config.model_config.max_model_len,
                    max_loras=self.config.lora_config.max_loras if self.config.lora_config else 0,
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
            kv_cache=kv_cache, phases=timer.seconds, workers=workers, spans=timer.spans, pid=os.getpid(),
        )
        trace_dir = envs.trace_dir()
        if trace_dir:
            from engine_ref.tracing import trace_file_name, write_startup_trace

            write_startup_trace(self.startup_report, os.path.join(trace_dir, trace_file_name(self.startup_report)))

    def _initialize_kv_caches(self) -> KVCacheSizing:
        """Size the KV cache from the most constrained rank and allocate it on every rank."""
        self.executor.determine_available_memory()  # the profile run on every rank
        memory = [report.memory for report in self.executor.worker_reports()]
        cache = self.config.cache_config
        sizing = size_kv_cache(memory, gpu_memory_utilization=cache.gpu_memory_utilization,
                               bytes_per_block=bytes_per_block(self.executor.get_kv_cache_specs()[0]),
                               block_size=cache.block_size, max_model_len=self.config.model_config.max_model_len,
                               num_blocks_override=cache.num_gpu_blocks_override)
        check_enough_kv_cache_memory(sizing, memory)
        self.executor.initialize_cache(sizing.num_blocks)
        return sizing

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read an adapter on every rank now (vLLM's add_lora), so a bad one fails before its requests run."""
        self.executor.collective_rpc("add_lora", args=(lora_request,))

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

    @property
    def worker_exits(self) -> list[WorkerExit]:
        """After shutdown: how each rank's worker ended (by itself, or needing SIGTERM / SIGKILL, and the
        non-daemon threads that kept it alive); empty before."""
        return self.executor.worker_exits
