"""WorkerProc: the process of one rank of a MultiprocExecutor, and the parent's handle on it.

A worker starts up (init_worker -> init_device -> load_model), answers READY (or its failure) over its
pipe, then serves ``(method, args, kwargs)`` calls until the shutdown message, which it answers once its
teardown returned, with the non-daemon threads it still runs. Messages are pickled with plain
``pickle`` and sent as bytes (see engine_ref.executor.multiproc).
"""

from __future__ import annotations

import pickle
import threading
from contextlib import suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from engine_ref.config import EngineConfig
from engine_ref.executor.protocol import WorkerWrapperBase
from engine_ref.executor.shutdown import live_threads, non_daemon_threads
from engine_ref.isolation import ERROR, OK, Failure, WarmProcess, describe_exitcode, get_mp_context, start_process

TORN_DOWN = "torn_down"  # a worker's answer to the shutdown message: (TORN_DOWN, the threads it still runs)


def _send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


@dataclass(eq=False)
class WorkerProcHandle:
    """The parent's side of one WorkerProc: its process and the pipe to it."""

    rank: int
    proc: WarmProcess
    conn: Connection
    pid: int = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.pid = self.proc.pid

    def exit_status(self) -> str:
        """'was killed by SIGKILL', 'exited with code 1', once the process ended (waits up to 1 s)."""
        with self._lock:  # a forkserver child's exit status can be read only once: not from two threads
            self.proc.join(1.0)
            return describe_exitcode(self.proc.exitcode)

    def describe_death(self) -> str:
        """'rank 1 (pid 123) was killed by SIGKILL'."""
        return f"rank {self.rank} (pid {self.pid}) {self.exit_status()}"


class WorkerProc(WorkerWrapperBase):
    """The process of one rank: init_worker -> init_device -> load_model, READY, then serve calls."""

    def __init__(self, config: EngineConfig, rank: int, distributed_init_method: str, conn: Connection) -> None:
        super().__init__(config, rank, distributed_init_method)
        self.conn = conn

    @staticmethod
    def make_worker_process(config: EngineConfig, rank: int, distributed_init_method: str) -> WorkerProcHandle:
        """Start the process of one rank; it begins init_device and load_model at once."""
        ctx = get_mp_context()
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = start_process(WorkerProc.worker_main, config, rank, distributed_init_method, child_conn,
                             name=f"WorkerProc-rank{rank}", ctx=ctx)
        child_conn.close()
        return WorkerProcHandle(rank, proc, parent_conn)

    @staticmethod
    def worker_main(config: EngineConfig, rank: int, distributed_init_method: str, conn: Connection) -> None:
        """The target of a worker process: start up, answer (OK: READY, or ERROR), then serve calls."""
        proc = WorkerProc(config, rank, distributed_init_method, conn)
        answer = proc.start_worker()
        _send(conn, answer)
        if answer[0] != OK:
            return
        try:
            proc.worker_busy_loop()
        finally:
            proc.shutdown()
            with suppress(OSError):  # the parent is gone when the pipe closed
                _send(conn, (TORN_DOWN, live_threads(non_daemon_threads())))

    def worker_busy_loop(self) -> None:
        """Serve ``(method, args, kwargs)`` calls until the shutdown message (None) or the pipe closes."""
        while True:
            try:
                message = pickle.loads(self.conn.recv_bytes())
            except EOFError:
                return
            if message is None:
                return
            method, args, kwargs = message
            if isinstance(method, bytes):  # a cloudpickled callable
                import cloudpickle

                method = cloudpickle.loads(method)
            try:
                _send(self.conn, self.execute_method(method, args, kwargs))
            except Exception as e:  # noqa: BLE001 - the result does not pickle
                _send(self.conn, (ERROR, Failure.capture(e)))
