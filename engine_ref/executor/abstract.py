"""Executor: the interface EngineCore drives, whatever runs the workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from engine_ref.config import EngineConfig
from engine_ref.engine.report import WorkerReport
from engine_ref.engine.scheduler import SchedulerOutput
from engine_ref.executor.shutdown import WorkerExit
from engine_ref.kv_cache.spec import FullAttentionSpec


class Executor(ABC):
    """Starts the workers (init_worker, init_device, load_model) in ``__init__``; calls them after.

    ``shutdown`` fills ``worker_exits``: how each rank's worker ended (see engine_ref.executor.shutdown).
    """

    # After a worker's teardown, for the non-daemon threads it still runs to end. Short: a worker that runs none is
    # not hurried by it (it has the executor's own grace to exit), and one that does would run them until killed.
    thread_grace_s: float = 1.0

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The executor class for ``parallel_config.distributed_executor_backend``."""
        backend = config.parallel_config.distributed_executor_backend
        if backend == "uni":
            from engine_ref.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from engine_ref.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from engine_ref.executor.ray_distributed import RayDistributedExecutor

            return RayDistributedExecutor
        raise ValueError(f"unknown distributed_executor_backend {backend!r}")

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.is_shutdown = False
        self.worker_exits: list[WorkerExit] = []  # rank order, filled by shutdown
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Create every worker and bring it through init_device and load_model."""

    @abstractmethod
    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``method`` on every worker; return their results in rank order."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker. Idempotent."""

    def determine_available_memory(self) -> list[int]:
        return self.collective_rpc("determine_available_memory")

    def get_kv_cache_specs(self) -> list[dict[str, FullAttentionSpec]]:
        return self.collective_rpc("get_kv_cache_spec")

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", args=(num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> list[int]:
        return self.collective_rpc("execute_model", args=(scheduler_output,))[0]

    def worker_reports(self) -> list[WorkerReport]:
        return self.collective_rpc("report")
