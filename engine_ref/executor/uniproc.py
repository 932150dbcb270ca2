"""UniProcExecutor: one worker, in this process."""

from __future__ import annotations

from typing import Any

from engine_ref.executor.abstract import Executor
from engine_ref.executor.protocol import RpcMethod
from engine_ref.worker.worker import Worker


class UniProcExecutor(Executor):
    """Runs the single rank of a tensor_parallel_size=1 engine in the calling process."""

    def _init_executor(self) -> None:
        self.worker = Worker(self.config, rank=0)
        try:
            self.worker.init_device()
            self.worker.load_model()
        except BaseException:
            self.worker.shutdown()
            raise

    def collective_rpc(self, method: RpcMethod, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        if isinstance(method, str):
            return [getattr(self.worker, method)(*args, **(kwargs or {}))]
        return [method(self.worker, *args, **(kwargs or {}))]  # fn(worker, *args), as the mp executor takes it

    def shutdown(self) -> None:
        if not self.is_shutdown:
            self.is_shutdown = True
            self.worker.shutdown()
