"""MultiprocExecutor: one WorkerProc (engine_ref.executor.worker_proc) per rank, each a warm fork (see
engine_ref.isolation).

Start method. Workers start through ``engine_ref.isolation.start_process``: by default each is a
fork of the forkserver, a process started by exec (so it holds no CUDA state, whatever this
process did) that preloaded torch. A worker therefore costs milliseconds and shares torch's pages
instead of importing it again (seconds). ENGINE_REF_WORKER_MULTIPROC_METHOD=fork forks this process
instead, and falls back to spawn, with a warning, once this process has initialized CUDA; spawn
starts a fresh interpreter per worker. No path forks a process that has initialized CUDA.

Rendezvous. Each engine's ranks meet through a torch.distributed FileStore in a private temp dir
(``file://<mkdtemp>/store``, inside this process's own temp dir, see engine_ref.isolation.tempdirs),
made at startup and removed once every rank is ready (the groups are formed by then; a failed
startup removes it at shutdown, and a parent killed before READY leaves it to the next start's
sweep). No port is chosen at all: a
port found free by probing can be taken by another engine before rank 0 binds it, whereas a fresh
directory belongs to one engine. gloo's own connections bind ports the kernel picks.

Startup. Every WorkerProc is created before any is waited on (init_device is a collective), each
runs init_worker -> init_device -> load_model and answers READY over its pipe. While waiting, the
executor watches every worker's process sentinel, so a worker that raises, dies or hangs fails
startup at once with its rank and its own traceback, signal or Python stacks (faulthandler).

After startup a monitor thread watches the sentinels: a worker that dies marks the executor dead
within milliseconds and takes the other workers down; every later call raises EngineDeadError
naming the rank and the signal. Shutdown asks politely, then SIGTERM, then SIGKILL to each
worker's process group; it is idempotent and also runs at interpreter exit. A worker answers the
shutdown message once its teardown returned, with the non-daemon threads it still runs (they keep
its process from exiting); ``worker_exits`` then says how each worker ended: by itself, or needing
SIGTERM or SIGKILL, with those threads or its stacks (see engine_ref.executor.shutdown). A worker
whose parent dies exits on its own (the death pipe, see engine_ref.isolation).

Messages are pickled with plain ``pickle`` and sent as bytes. ``Connection.send`` would use
multiprocessing's ForkingPickler, through which torch moves tensors (a Llava request's pixels) into
shared memory and starts a resource-sharer thread and socket that outlive the call.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import pickle
import shutil
import tempfile
import threading
import time
import weakref
from contextlib import suppress
from typing import Any, NoReturn

from engine_ref.errors import EngineDeadError
from engine_ref.executor.abstract import Executor
from engine_ref.executor.protocol import (
    RpcMethod,
    WorkerError,
    not_ready_error,
    rpc_name,
    rpc_timeout_error,
    startup_error,
    startup_failure,
    worker_error,
)
from engine_ref.executor.shutdown import EndedBy, LiveThread, WorkerExit
from engine_ref.executor.worker_proc import TORN_DOWN, WorkerProc, WorkerProcHandle
from engine_ref.isolation import ERROR, OK, AnswerWait, Deadline, describe_exitcode
from engine_ref.isolation.tempdirs import owner_dir

logger = logging.getLogger(__name__)


class MultiprocExecutor(Executor):
    """Runs each rank in its own process; all ranks form one gloo (CPU) or nccl (CUDA) group."""

    shutdown_grace_s: float = 5.0  # after the shutdown message, before SIGTERM
    terminate_grace_s: float = 1.0  # after SIGTERM, before SIGKILL
    rpc_error_grace_s: float = 5.0  # after one rank raised, how long the others may take to answer

    def _init_executor(self) -> None:
        self.world_size = self.config.parallel_config.world_size
        self.workers: list[WorkerProcHandle] = []
        self.dead_reason: str | None = None
        self._state_lock = threading.Lock()  # dead_reason and is_shutdown
        self._rpc_lock = threading.Lock()  # one collective_rpc at a time
        self._monitor: threading.Thread | None = None
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)  # wakes the monitor at shutdown
        self._tmp_dir: str | None = None
        self.exit_statuses: dict[int, str] = {}  # rank -> how its process ended, filled by shutdown
        self._ready = False
        _live_executors.add(self)
        try:
            self._tmp_dir = tempfile.mkdtemp(prefix="mp-", dir=owner_dir())
            self.distributed_init_method = f"file://{self._tmp_dir}/store"
            for rank in range(self.world_size):  # all of them before waiting on any
                self.workers.append(
                    WorkerProc.make_worker_process(self.config, rank, self.distributed_init_method))
            self._wait_for_ready(Deadline(self.config.parallel_config.ready_timeout_s))
            self._ready = True
            # Every group is formed: gloo and nccl need the store no more, so a parent killed from
            # now on leaves no directory behind.
            self._remove_tmp_dir()
        except BaseException:
            self._kill_workers()
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._monitor_workers, daemon=True, name="WorkerMonitor")
        self._monitor.start()

    def _wait_for_ready(self, deadline: Deadline) -> None:
        """Return once every worker answered READY; raise WorkerStartupError at the first failure."""
        wait = AnswerWait({w: w.conn for w in self.workers}, {w: w.proc.sentinel for w in self.workers}, deadline,
                          watch_answered=True)
        ready: set[WorkerProcHandle] = set()
        for worker, message in wait:
            if message is None:  # it died without a word
                when = "after" if worker in ready else "before"
                raise startup_error(worker.rank, worker.pid,
                                    f"{worker.exit_status()} during startup, {when} it was ready.")
            status, failure = pickle.loads(message)
            if status == ERROR:
                raise startup_failure(worker.rank, worker.pid, failure)
            ready.add(worker)
        if wait.pending:
            raise not_ready_error({w.rank: (w.pid, w.proc.dump_stacks()) for w in wait.pending}, deadline.seconds)

    def _monitor_workers(self) -> None:
        """Notice the first worker to die: mark the engine dead and kill the other workers."""
        sentinels = {w.proc.sentinel: w for w in self.workers}
        ready = multiprocessing.connection.wait([*sentinels, self._wake_r])
        if self.is_shutdown or self._wake_r in ready:
            return
        dead = min((sentinels[s] for s in ready if s in sentinels), key=lambda w: w.rank)
        self._mark_dead(f"Worker {dead.describe_death()}; the engine is dead. Start a new engine.")

    def _mark_dead(self, reason: str) -> None:
        """Record why the engine died (the first reason wins) and kill every worker."""
        with self._state_lock:
            if self.dead_reason is None and not self.is_shutdown:
                self.dead_reason = reason
                logger.error("%s", reason)
        self._kill_workers()

    def _kill_workers(self) -> None:
        for worker in self.workers:
            worker.proc.kill_tree()

    def _check_alive(self) -> None:
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        if self.is_shutdown:
            raise EngineDeadError("The engine has been shut down; start a new engine.")

    def collective_rpc(self, method: RpcMethod, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``method`` (a Worker method name, or ``fn(worker, *args)``) on every rank; results in rank order.

        A rank that raises raises WorkerError here, once the other ranks answered. A rank that dies,
        or a call that outlives ``timeout`` seconds (default ``rpc_timeout_s``; RpcTimeoutError, with the
        stacks of the ranks that did not answer), leaves the engine dead and its workers killed: its
        ranks can no longer be trusted to be in step.
        """
        if timeout is None:
            timeout = self.config.parallel_config.rpc_timeout_s
        name = rpc_name(method)
        if not isinstance(method, str):
            import cloudpickle

            method = cloudpickle.dumps(method)
        payload = pickle.dumps((method, args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        with self._rpc_lock:
            self._check_alive()
            for worker in self.workers:
                try:
                    worker.conn.send_bytes(payload)
                except OSError:
                    self._raise_dead(worker, name)
            return self._gather(name, Deadline(timeout))

    def _gather(self, name: str, deadline: Deadline) -> list[Any]:
        results: dict[int, Any] = {}
        errors: list[WorkerError] = []
        wait = AnswerWait({w: w.conn for w in self.workers}, {w: w.proc.sentinel for w in self.workers}, deadline,
                          watch_answered=True)
        for worker, message in wait:
            if message is None:
                self._raise_dead(worker, name)
            status, value = pickle.loads(message)
            if status == OK:
                results[worker.rank] = value
                continue
            errors.append(worker_error(name, worker.rank, value))
            deadline.shorten(self.rpc_error_grace_s)  # the others may be waiting for it in a collective
        if wait.pending:
            self._timed_out(name, list(wait.pending), deadline.seconds, errors)
        if errors:
            raise min(errors, key=lambda e: e.rank)
        return [results[w.rank] for w in self.workers]

    def _timed_out(self, name: str, stuck: list[WorkerProcHandle], timeout: float | None,
                   errors: list[WorkerError]) -> NoReturn:
        """Some ranks did not answer by the deadline: dump their stacks, kill every worker, raise.

        When another rank raised and the stuck ones did not follow within the grace, that rank's error
        is the root cause (the stuck ones wait for it in a collective), unless what it raised is its
        collective timing out: then it was waiting for a stuck rank, which is the root cause.
        """
        ranks = ", ".join(str(w.rank) for w in stuck)
        if errors and not any(e.type_name == "CollectiveTimeoutError" for e in errors):
            self._mark_dead(f"{name} failed on rank {errors[0].rank}, and rank {ranks} did not answer within "
                            f"{self.rpc_error_grace_s:g} s after it (stuck in a collective with it); the engine is "
                            f"dead. Start a new engine.")
            raise errors[0]
        error = rpc_timeout_error(name, {w.rank: (w.pid, w.proc.dump_stacks()) for w in stuck}, timeout, errors,
                                  self.rpc_error_grace_s)
        self._mark_dead(str(error))
        raise error

    def _raise_dead(self, worker: WorkerProcHandle, name: str) -> NoReturn:
        if self.dead_reason is None:  # else the monitor already named the first worker to die
            self._mark_dead(f"Worker {worker.describe_death()} during {name}; the engine is dead. "
                            f"Start a new engine.")
        raise EngineDeadError(self.dead_reason or "The engine has been shut down; start a new engine.")

    def shutdown(self) -> None:
        """Ask each worker to exit, then SIGTERM, then SIGKILL its process group; record how each ended in
        ``worker_exits``; clean up. Idempotent."""
        with self._state_lock:
            if self.is_shutdown:
                return
            self.is_shutdown = True
        _live_executors.discard(self)
        self._wake_w.send_bytes(b"")
        if self._monitor is not None:
            self._monitor.join()
        # A call still running in another thread owns the pipes: then go straight to SIGTERM.
        polite = self._rpc_lock.acquire(timeout=self.shutdown_grace_s)
        try:
            self.worker_exits = self._end_workers(self._ask_to_exit() if polite else {})
        finally:
            if polite:
                self._rpc_lock.release()
        for end in self.worker_exits:
            self.exit_statuses[end.rank] = end.status
            if not end.clean and self._ready and self.dead_reason is None:
                logger.warning("Worker %s.", end.describe())
        self._wake_r.close()
        self._wake_w.close()
        self._remove_tmp_dir()

    def _ask_to_exit(self) -> dict[WorkerProcHandle, tuple[LiveThread, ...]]:
        """Send each worker the shutdown message and wait for it to exit by itself; return the threads each
        worker that answered still ran after its teardown.

        Each worker has ``shutdown_grace_s`` to answer (its teardown), then to exit from its answer on; one
        that answered with live non-daemon threads, which would keep it alive for as long as they run, only
        ``thread_grace_s`` from the last answer on.
        """
        asked = []
        for worker in self.workers:
            with suppress(OSError):
                if worker.proc.is_alive():  # not one the engine's death took down
                    worker.conn.send_bytes(pickle.dumps(None))
                    asked.append(worker)
        answered: dict[WorkerProcHandle, tuple[LiveThread, ...]] = {}
        exit_by: dict[WorkerProcHandle, float] = {}
        wait = AnswerWait({w: w.conn for w in asked}, {w: w.proc.sentinel for w in asked},
                          Deadline(self.shutdown_grace_s))
        for worker, message in wait:
            tag, threads = pickle.loads(message) if message is not None else (None, ())
            if tag == TORN_DOWN:  # not a stale answer of a call the engine gave up on
                answered[worker] = threads
                exit_by[worker] = time.monotonic() + self.shutdown_grace_s
        threads_deadline = time.monotonic() + self.thread_grace_s
        for worker in self.workers:
            at = threads_deadline if answered.get(worker) else exit_by.get(worker, 0.0)
            worker.proc.join(max(0.0, at - time.monotonic()))
        return answered

    def _end_workers(self, answered: dict[WorkerProcHandle, tuple[LiveThread, ...]]) -> list[WorkerExit]:
        """SIGTERM each worker still running (dumping its stacks first when it did not answer after its teardown),
        SIGKILL its group after ``terminate_grace_s``; reap it; say how each ended."""
        ended_by: dict[WorkerProcHandle, EndedBy] = {}
        stacks: dict[WorkerProcHandle, str] = {}
        for worker in self.workers:
            if worker.proc.is_alive():
                if worker not in answered:
                    stacks[worker] = worker.proc.dump_stacks()
                ended_by[worker] = "SIGTERM"
                worker.proc.terminate()
        deadline = Deadline(self.terminate_grace_s)
        exits = []
        for worker in self.workers:
            worker.proc.join(deadline.remaining())
            if worker.proc.is_alive():
                ended_by[worker] = "SIGKILL"
            worker.proc.kill_tree()  # SIGKILL to its group: the worker if it is still there, and stragglers
            worker.proc.join()
            how = ended_by.get(worker, "itself")
            exits.append(WorkerExit(worker.rank, worker.pid, how, describe_exitcode(worker.proc.exitcode),
                                    answered.get(worker, ()) if how != "itself" else (), stacks.get(worker, "")))
            worker.proc.close()
            worker.conn.close()
        return exits

    def _remove_tmp_dir(self) -> None:
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None


_live_executors: weakref.WeakSet[MultiprocExecutor] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for executor in list(_live_executors):
        executor.shutdown()
