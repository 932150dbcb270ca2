"""MultiprocExecutor: one WorkerProc per rank, each a warm fork (see engine_ref.isolation).

Startup: every WorkerProc is created before any is waited on (init_device is a collective), each
runs init_worker -> init_device -> load_model and answers READY over its pipe. While waiting,
the executor watches every worker's process sentinel, so a worker that raises, dies or hangs
fails startup at once with its rank and its own traceback, signal or Python stacks.

After startup a monitor thread watches the sentinels: a worker that dies marks the executor
dead within milliseconds, and every later call raises EngineDeadError naming rank and signal.
Shutdown asks politely, then SIGTERM, then SIGKILL to each worker's process group; it is
idempotent and also runs at interpreter exit.
"""

from __future__ import annotations

import atexit
import multiprocessing.connection
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from engine_ref.config import EngineConfig
from engine_ref.errors import EngineDeadError, WorkerStartupError
from engine_ref.executor.abstract import Executor
from engine_ref.isolation import WarmProcess, describe_exitcode, get_mp_context, start_process
from engine_ref.utils import get_open_port

SHUTDOWN_GRACE_S = 5.0
_READY, _FAILED, _OK, _ERROR = "ready", "failed", "ok", "error"


class WorkerError(Exception):
    """An exception a worker raised while serving a call, with the worker's own traceback."""


@dataclass
class WorkerProcHandle:
    """The parent's side of one WorkerProc: its process and the pipe to it."""

    rank: int
    proc: WarmProcess
    conn: Connection

    def describe_death(self) -> str:
        return f"rank {self.rank} (pid {self.proc.pid}) {describe_exitcode(self.proc.exitcode)}"


class WorkerProc:
    """The worker loop that runs in each rank's process."""

    @staticmethod
    def make_worker_process(config: EngineConfig, rank: int, distributed_init_method: str) -> WorkerProcHandle:
        """Start the process of one rank (it begins init_device and load_model at once)."""
        ctx = get_mp_context()
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = start_process(WorkerProc.worker_main, config, rank, distributed_init_method, child_conn,
                             name=f"WorkerProc-rank{rank}", ctx=ctx)
        child_conn.close()
        return WorkerProcHandle(rank, proc, parent_conn)

    @staticmethod
    def worker_main(config: EngineConfig, rank: int, distributed_init_method: str, conn: Connection) -> None:
        from engine_ref.worker.worker import Worker

        try:
            worker = Worker(config, rank, distributed_init_method)  # init_worker
            worker.init_device()
            worker.load_model()
        except BaseException:  # noqa: BLE001 - reported to the parent verbatim
            conn.send((_FAILED, traceback.format_exc()))
            return
        conn.send((_READY, None))
        try:
            while True:
                try:
                    message = conn.recv()
                except EOFError:
                    break
                if message is None:  # shutdown
                    break
                method, args, kwargs = message
                try:
                    conn.send((_OK, getattr(worker, method)(*args, **kwargs)))
                except Exception:  # noqa: BLE001 - the parent raises it
                    conn.send((_ERROR, traceback.format_exc()))
        finally:
            worker.shutdown()


class MultiprocExecutor(Executor):
    """Runs each rank in its own process; all ranks form one gloo (CPU) or nccl (CUDA) group."""

    def _init_executor(self) -> None:
        self.world_size = self.config.parallel_config.world_size
        self.distributed_init_method = f"tcp://127.0.0.1:{get_open_port()}"
        self.workers: list[WorkerProcHandle] = []
        self.dead_reason: str | None = None
        self._lock = threading.Lock()  # one collective_rpc at a time
        _live_executors.add(self)
        try:
            for rank in range(self.world_size):
                self.workers.append(
                    WorkerProc.make_worker_process(self.config, rank, self.distributed_init_method))
            self._wait_for_ready(self.config.parallel_config.ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._monitor_workers, daemon=True, name="WorkerMonitor")
        self._monitor.start()

    def _wait_for_ready(self, timeout: float) -> None:
        pending = list(self.workers)
        deadline = time.monotonic() + timeout
        while pending:
            waitables = [w.conn for w in pending] + [w.proc.sentinel for w in pending]
            ready = multiprocessing.connection.wait(waitables, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                stacks = "\n".join(f"--- rank {w.rank} (pid {w.proc.pid}) ---\n{w.proc.dump_stacks()}"
                                   for w in pending)
                raise WorkerStartupError(
                    f"{len(pending)} worker(s) (rank {', '.join(str(w.rank) for w in pending)}) were not ready "
                    f"within {timeout:g} s (ready_timeout_s / ENGINE_REF_READY_TIMEOUT_S) and were killed. "
                    f"Their Python stacks:\n{stacks}"
                )
            for worker in list(pending):
                if worker.conn.poll():
                    try:
                        status, detail = worker.conn.recv()
                    except EOFError:
                        status, detail = _FAILED, None
                    if status != _READY:
                        worker.proc.join(1)
                        raise WorkerStartupError(
                            f"Worker rank {worker.rank} (pid {worker.proc.pid}) failed during startup:\n"
                            f"{detail or describe_exitcode(worker.proc.exitcode)}")
                    pending.remove(worker)
                elif worker.proc.sentinel in ready:
                    worker.proc.join(1)
                    raise WorkerStartupError(f"Worker {worker.describe_death()} during startup, before it was ready.")

    def _monitor_workers(self) -> None:
        """Notice the first worker to die; mark the engine dead and kill the other workers."""
        sentinels = {w.proc.sentinel: w for w in self.workers}
        dead = multiprocessing.connection.wait(list(sentinels))
        if self.is_shutdown:
            return
        self.dead_reason = f"Worker {sentinels[dead[0]].describe_death()}; the engine is dead."
        for worker in self.workers:
            worker.proc.kill_tree()

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        with self._lock:
            if self.dead_reason or self.is_shutdown:
                raise EngineDeadError(self.dead_reason or "the executor has been shut down")
            for worker in self.workers:
                worker.conn.send((method, args, kwargs or {}))
            deadline = None if timeout is None else time.monotonic() + timeout
            results: list[Any] = []
            for worker in self.workers:
                results.append(self._receive(worker, method, deadline))
            return results

    def _receive(self, worker: WorkerProcHandle, method: str, deadline: float | None) -> Any:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait([worker.conn, worker.proc.sentinel], timeout=remaining)
        if worker.conn in ready or worker.conn.poll():
            try:
                status, value = worker.conn.recv()
            except EOFError:
                status = None
            if status == _OK:
                return value
            if status == _ERROR:
                raise WorkerError(f"{method} failed on rank {worker.rank}:\n{value}")
        if not ready:
            raise TimeoutError(f"{method} did not finish on rank {worker.rank} within the timeout")
        worker.proc.join(1)
        self.dead_reason = f"Worker {worker.describe_death()} during {method}; the engine is dead."
        raise EngineDeadError(self.dead_reason)

    def shutdown(self) -> None:
        """Ask each worker to exit, then SIGTERM, then SIGKILL its process group. Idempotent."""
        with _shutdown_lock:
            if self.is_shutdown:
                return
            self.is_shutdown = True
        for worker in self.workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for worker in self.workers:
            worker.proc.join(max(0.0, deadline - time.monotonic()))
        for worker in self.workers:
            worker.proc.terminate()
        for worker in self.workers:
            worker.proc.join(1.0)
            worker.proc.close()  # SIGKILLs whatever is left, reaps, closes pipes
            worker.conn.close()
        _live_executors.discard(self)


_shutdown_lock = threading.Lock()
_live_executors: weakref.WeakSet[MultiprocExecutor] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for executor in list(_live_executors):
        executor.shutdown()
