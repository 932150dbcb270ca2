"""RayDistributedExecutor: each rank a Ray actor running the same Worker (``distributed_executor_backend="ray"``).

The alternative to the multiprocess executor, as in vLLM. It needs the optional extra
``ray`` (``pip install 'pytest-enginecheck[ray]'``). When this process has no Ray running, the
executor starts a local one (``ray.init`` with as many CPUs as ranks, no dashboard, its session
files in the engine's private temp dir) and shuts it down at shutdown; a Ray the caller started is
left running.

The actors go through the WorkerProc lifecycle: all are created before any is waited on, each runs
init_worker -> init_device (gloo on CPU, nccl on CUDA, meeting through the engine's private
FileStore) -> load_model and answers READY. A rank that raises fails startup with its traceback; a
rank that dies fails it with Ray's account of the death; ranks that hang past ``ready_timeout_s``
have their Python stacks dumped (faulthandler, through a named pipe in the engine's temp dir) and are
killed.

Ray actors are fresh interpreters started by Ray's raylet, not forks of a warm parent: each pays
the torch import. Use the multiprocess executor where start time matters.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
from contextlib import suppress
from pathlib import Path
from typing import Any

from engine_ref.config import EngineConfig
from engine_ref.errors import ConfigError, EngineDeadError
from engine_ref.executor.abstract import Executor
from engine_ref.executor.protocol import (
    RpcMethod,
    WorkerWrapperBase,
    not_ready_error,
    rpc_name,
    rpc_timeout_error,
    startup_error,
    startup_failure,
    worker_error,
)
from engine_ref.isolation import ERROR, Deadline
from engine_ref.isolation.process import request_stacks
from engine_ref.isolation.tempdirs import mkdtemp_beside
from engine_ref.isolation.wait import read_burst

STACK_DUMP_WAIT_S = 1.0  # at most, for an actor's faulthandler to start writing its stacks


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "distributed_executor_backend='ray' needs Ray, which is not installed; install the extra "
            "(pip install 'pytest-enginecheck[ray]') or use distributed_executor_backend='mp'."
        ) from None
    return ray


class RayWorkerWrapper(WorkerWrapperBase):
    """The body of one rank's Ray actor: the same Worker a WorkerProc runs, driven by method calls."""

    def __init__(self, config: EngineConfig, rank: int, distributed_init_method: str, stack_fifo: str) -> None:
        super().__init__(config, rank, distributed_init_method)
        # Read and write: opening does not wait for a reader, and the driver reads a dump when it asks for one.
        self._stacks = os.open(stack_fifo, os.O_RDWR)
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)

    def get_pid(self) -> int:
        return os.getpid()


class RayDistributedExecutor(Executor):
    """Runs each rank as a Ray actor on a local Ray; same worker lifecycle and report as ``mp``."""

    shutdown_grace_s: float = 5.0  # for the actors' own shutdown, before ray.kill

    def _init_executor(self) -> None:
        ray = _import_ray()
        self.world_size = self.config.parallel_config.world_size
        self.dead_reason: str | None = None
        self.actors: list[Any] = []
        self.pids: list[int | None] = [None] * self.world_size
        self._tmp_dir = mkdtemp_beside("ray")  # swept if this process is killed
        self.distributed_init_method = f"file://{self._tmp_dir}/store"
        self.started_ray = False
        try:
            if not ray.is_initialized():
                # Ray's session files (logs, sockets) go to the engine's temp dir, removed at shutdown.
                ray.init(num_cpus=self.world_size, include_dashboard=False, log_to_driver=False,
                         _temp_dir=self._tmp_dir, namespace="engine_ref")
                self.started_ray = True
            self._start_actors(ray, Deadline(self.config.parallel_config.ready_timeout_s))
        except BaseException:
            self.shutdown()
            raise

    def _start_actors(self, ray: Any, deadline: Deadline) -> None:
        on_cuda = self.config.device_config.device == "cuda"
        resource = "GPU" if on_cuda else "CPU"
        free = ray.available_resources().get(resource, 0)
        if free < self.world_size:  # the actors would wait for them until the ready timeout
            raise ConfigError(
                f"Ray has {free:g} free {resource}s, but tensor_parallel_size={self.world_size} needs one per rank; "
                f"start Ray with more (ray.init(num_cpus=...)) or let the engine start its own."
            )
        actor_cls = ray.remote(num_cpus=0 if on_cuda else 1, num_gpus=1 if on_cuda else 0,
                               max_restarts=0)(RayWorkerWrapper)
        for rank in range(self.world_size):
            os.mkfifo(self._stack_fifo(rank))
        self.actors = [actor_cls.remote(self.config, rank, self.distributed_init_method, self._stack_fifo(rank))
                       for rank in range(self.world_size)]  # all of them before waiting on any
        pids = self._wait_all(ray, [a.get_pid.remote() for a in self.actors], deadline)
        self.pids = [pid for _, pid in sorted(pids.items())]
        self._wait_all(ray, [a.start_worker.remote() for a in self.actors], deadline)
        Path(self._tmp_dir, "store").unlink(missing_ok=True)  # the groups are formed: the rendezvous is over

    def _wait_all(self, ray: Any, refs: list[Any], deadline: Deadline) -> dict[int, Any]:
        """Every rank's answer; raise at the first failure or at the deadline."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        answers: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=deadline.remaining())
            if not done:
                ranks = sorted(rank_of[r] for r in pending)
                raise not_ready_error({r: (self.pids[r], self._dump_stacks(r)) for r in ranks}, deadline.seconds,
                                      f", or check that Ray has {self.world_size} free CPUs")
            rank = rank_of[done[0]]
            try:
                answers[rank] = answer = ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                raise startup_error(rank, self.pids[rank], f"died during startup, before it was ready: {e}") from None
            if isinstance(answer, tuple) and answer[0] == ERROR:  # report it now, not after the others
                raise startup_failure(rank, self.pids[rank], answer[1])
        return answers

    def _stack_fifo(self, rank: int) -> str:
        return str(Path(self._tmp_dir) / f"stacks-rank{rank}")

    def _dump_stacks(self, rank: int) -> str:
        pid = self.pids[rank]
        if pid is None:
            return "(the actor had not started)"
        fd = os.open(self._stack_fifo(rank), os.O_RDONLY | os.O_NONBLOCK)
        try:
            note = request_stacks(pid)
            return "(the actor is gone)" if note is None else note + read_burst(fd, STACK_DUMP_WAIT_S)
        finally:
            os.close(fd)

    def collective_rpc(self, method: RpcMethod, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``method`` (a Worker method name, or ``fn(worker, *args)``) on every rank; results in rank order.

        A call that outlives ``timeout`` (default ``rpc_timeout_s``) raises RpcTimeoutError with the stacks
        of the ranks that did not answer, and leaves the engine dead, its actors killed.
        """
        ray = _import_ray()
        if self.dead_reason or self.is_shutdown:
            raise EngineDeadError(self.dead_reason or "The engine has been shut down; start a new engine.")
        if timeout is None:
            timeout = self.config.parallel_config.rpc_timeout_s
        name = rpc_name(method)
        refs = [a.execute_method.remote(method, args, kwargs or {}) for a in self.actors]
        try:
            answers = ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            stuck = [rank for rank, ref in enumerate(refs) if ref not in done]
            errors = [worker_error(name, rank, answer[1]) for rank, ref in enumerate(refs) if ref in done
                      for answer in [ray.get(ref)] if answer[0] == ERROR]
            error = rpc_timeout_error(name, {r: (self.pids[r], self._dump_stacks(r)) for r in stuck}, timeout, errors)
            self._mark_dead(str(error))
            raise error from None
        except ray.exceptions.RayActorError as e:
            rank = next((r for r, ref in enumerate(refs) if _failed(ray, ref)), -1)
            self._mark_dead(f"Worker rank {rank} (pid {self.pids[rank] if rank >= 0 else '?'}) died during "
                            f"{name}: {e}; the engine is dead. Start a new engine.")
            raise EngineDeadError(self.dead_reason) from None
        results = []
        for rank, (status, value) in enumerate(answers):
            if status == ERROR:
                raise worker_error(name, rank, value)
            results.append(value)
        return results

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        self._kill_actors()

    def _kill_actors(self) -> None:
        ray = _import_ray()
        for actor in self.actors:
            with suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)

    def shutdown(self) -> None:
        """Stop the workers (politely, then ray.kill), stop the Ray this executor started, remove the temp dir.

        Idempotent.
        """
        if self.is_shutdown:
            return
        self.is_shutdown = True
        ray = _import_ray()
        if ray.is_initialized():
            if self.actors and self.dead_reason is None:
                # Leave the process group and drop the model, as a WorkerProc does; one that cannot is killed below.
                with suppress(Exception):
                    ray.get([a.shutdown.remote() for a in self.actors], timeout=self.shutdown_grace_s)
            self._kill_actors()
            if self.started_ray:
                ray.shutdown()
        self.actors = []
        shutil.rmtree(self._tmp_dir, ignore_errors=True)


def _failed(ray: Any, ref: Any) -> bool:
    """Whether the task behind ``ref`` ended with its actor's death."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # noqa: BLE001 - not finished, or failed otherwise
        return False
    return False
