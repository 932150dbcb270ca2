"""UniProcExecutor: one worker, in this process."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from engine_ref.executor.abstract import Executor
from engine_ref.executor.protocol import RpcMethod
from engine_ref.executor.shutdown import IN_PROCESS, WorkerExit, join_threads, non_daemon_threads
from engine_ref.worker.worker import Worker

logger = logging.getLogger(__name__)


class UniProcExecutor(Executor):
    """Runs the single rank of a tensor_parallel_size=1 engine in the calling process.

    Its worker has no process of its own to exit: at shutdown, the non-daemon threads started during the
    engine's life get ``thread_grace_s`` to end, and those still alive are its WorkerExit's ``threads`` (they
    would keep this process from exiting, as they keep a WorkerProc from exiting).
    """

    def _init_executor(self) -> None:
        self._threads_before = set(threading.enumerate())
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
            left = join_threads(non_daemon_threads(exclude=self._threads_before), self.thread_grace_s)
            self.worker_exits = [WorkerExit(0, os.getpid(), "itself", IN_PROCESS, left)]
            if left:
                logger.warning("The engine shut down, but %s.", self.worker_exits[0].describe())
