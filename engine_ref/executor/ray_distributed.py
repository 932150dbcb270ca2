"""RayDistributedExecutor: each rank a Ray actor running the same Worker (``distributed_executor_backend="ray"``).

The seed's alternative to the multiprocess executor, as in vLLM. It needs the optional extra
``ray`` (``pip install 'pytest-enginecheck[ray]'``). When this process has no Ray running, the
executor starts a local one (``ray.init`` with as many CPUs as ranks, no dashboard, its session
files in the engine's private temp dir) and shuts it down at shutdown; a Ray the caller started is
left running.

The actors go through the WorkerProc lifecycle: all are created before any is waited on, each runs
init_worker -> init_device (gloo on CPU, nccl on CUDA, meeting through the engine's private
FileStore) -> load_model and answers READY. A rank that raises fails startup with its traceback; a
rank that dies fails it with Ray's account of the death; ranks that hang past ``ready_timeout_s``
have their Python stacks dumped (faulthandler, into the engine's temp dir) and are killed.

Ray actors are fresh interpreters started by Ray's raylet, not forks of a warm parent: each pays
the torch import. Use the multiprocess executor where start time matters.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

from engine_ref.config import DEFAULT_READY_TIMEOUT_S, EngineConfig
from engine_ref.errors import ConfigError, EngineDeadError, WorkerStartupError
from engine_ref.executor.abstract import Executor
from engine_ref.executor.multiproc import ERROR, FAILED, OK, READY, RpcMethod, WorkerError, startup_error
from engine_ref.isolation import RemoteTraceback

STACK_DUMP_WAIT_S = 0.25  # for faulthandler to write an actor's stacks


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "distributed_executor_backend='ray' needs Ray, which is not installed; install the extra "
            "(pip install 'pytest-enginecheck[ray]') or use distributed_executor_backend='mp'."
        ) from None
    return ray


class RayWorkerWrapper:
    """The body of one rank's Ray actor: the same Worker a WorkerProc runs, driven by method calls."""

    def __init__(self, config: EngineConfig, rank: int, distributed_init_method: str, stack_file: str) -> None:
        self.config, self.rank = config, rank
        self.distributed_init_method = distributed_init_method
        self.worker: Any = None
        self._stacks = open(stack_file, "w")  # noqa: SIM115 - faulthandler writes here for the actor's life
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)

    def get_pid(self) -> int:
        return os.getpid()

    def start_worker(self) -> tuple[str, Any]:
        """init_worker -> init_device -> load_model; ``(READY, None)`` or ``(FAILED, (phase, traceback))``."""
        from engine_ref.worker.worker import Worker

        phase = "init_worker"
        try:
            self.worker = Worker(self.config, self.rank, self.distributed_init_method)
            phase = "init_device"
            self.worker.init_device()
            phase = "load_model"
            self.worker.load_model()
        except BaseException:  # noqa: BLE001 - reported to the driver verbatim
            return FAILED, (phase, traceback.format_exc())
        return READY, None

    def execute_method(self, method: RpcMethod, args: tuple, kwargs: dict[str, Any]) -> tuple[str, Any]:
        """Call a Worker method by name, or ``method(worker, *args)``; ``(OK, result)`` or ``(ERROR, traceback)``."""
        try:
            func = getattr(self.worker, method) if isinstance(method, str) else method
            result = func(*args, **kwargs) if isinstance(method, str) else func(self.worker, *args, **kwargs)
        except Exception:  # noqa: BLE001 - the driver raises it, naming this rank
            return ERROR, traceback.format_exc()
        return OK, result

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None


class RayDistributedExecutor(Executor):
    """Runs each rank as a Ray actor on a local Ray; same worker lifecycle and report as ``mp``."""

    shutdown_grace_s: float = 5.0  # for the actors' own shutdown, before ray.kill

    def _init_executor(self) -> None:
        ray = _import_ray()
        self.world_size = self.config.parallel_config.world_size
        self.dead_reason: str | None = None
        self.actors: list[Any] = []
        self.pids: list[int | None] = [None] * self.world_size
        self._tmp_dir = tempfile.mkdtemp(prefix="engine_ref-ray-")
        self.distributed_init_method = f"file://{self._tmp_dir}/store"
        self.started_ray = False
        try:
            if not ray.is_initialized():
                # Ray's session files (logs, sockets) go to the engine's temp dir, removed at shutdown.
                ray.init(num_cpus=self.world_size, include_dashboard=False, log_to_driver=False,
                         _temp_dir=self._tmp_dir, namespace="engine_ref")
                self.started_ray = True
            self._start_actors(ray, self.config.parallel_config.ready_timeout_s or DEFAULT_READY_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def _start_actors(self, ray: Any, timeout: float) -> None:
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
        self.actors = [actor_cls.remote(self.config, rank, self.distributed_init_method, self._stack_file(rank))
                       for rank in range(self.world_size)]  # all of them before waiting on any
        deadline = time.monotonic() + timeout
        pids = self._wait_all(ray, [a.get_pid.remote() for a in self.actors], deadline, timeout)
        self.pids = [pid for _, pid in sorted(pids.items())]
        self._wait_all(ray, [a.start_worker.remote() for a in self.actors], deadline, timeout)
        Path(self._tmp_dir, "store").unlink(missing_ok=True)  # the groups are formed: the rendezvous is over

    def _wait_all(self, ray: Any, refs: list[Any], deadline: float, timeout: float) -> dict[int, Any]:
        """Every rank's answer; raise at the first failure or at the deadline."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        answers: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise self._ready_timeout_error(sorted(rank_of[r] for r in pending), timeout)
            rank = rank_of[done[0]]
            try:
                answers[rank] = ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                raise startup_error(rank, self.pids[rank], f"died during startup, before it was ready: {e}") from None
            answer = answers[rank]
            if isinstance(answer, tuple) and answer[0] == FAILED:  # report it now, not after the others
                phase, remote_traceback = answer[1]
                raise startup_error(rank, self.pids[rank],
                                    f"failed in {phase}: {remote_traceback.strip().splitlines()[-1]}",
                                    remote_traceback)
        return answers

    def _stack_file(self, rank: int) -> str:
        return str(Path(self._tmp_dir) / f"stacks-rank{rank}.txt")

    def _dump_stacks(self, rank: int) -> str:
        pid = self.pids[rank]
        if pid is None:
            return "(the actor had not started)"
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            return "(the actor is gone)"
        time.sleep(STACK_DUMP_WAIT_S)
        return Path(self._stack_file(rank)).read_text() or "(none could be read)"

    def _ready_timeout_error(self, ranks: list[int], timeout: float) -> WorkerStartupError:
        stacks = "\n".join(f"--- rank {r} (pid {self.pids[r]}) ---\n{self._dump_stacks(r)}" for r in ranks)
        were = "was" if len(ranks) == 1 else "were"
        return WorkerStartupError(
            f"Worker rank {', '.join(map(str, ranks))} {were} not ready within {timeout:g} s (ready_timeout_s / "
            f"ENGINE_REF_READY_TIMEOUT_S) and {were} killed. Raise ready_timeout_s if loading is only slow, or "
            f"check that Ray has {self.world_size} free CPUs. Python stacks at the timeout:\n{stacks}"
        )

    def collective_rpc(self, method: RpcMethod, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``method`` (a Worker method name, or ``fn(worker, *args)``) on every rank; results in rank order."""
        ray = _import_ray()
        if self.dead_reason or self.is_shutdown:
            raise EngineDeadError(self.dead_reason or "The engine has been shut down; start a new engine.")
        name = method if isinstance(method, str) else getattr(method, "__qualname__", "a function")
        refs = [a.execute_method.remote(method, args, kwargs or {}) for a in self.actors]
        try:
            answers = ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            self._mark_dead(f"{name} did not finish within {timeout:g} s; the engine is dead. Start a new engine.")
            raise TimeoutError(self.dead_reason) from None
        except ray.exceptions.RayActorError as e:
            rank = next((r for r, ref in enumerate(refs) if _failed(ray, ref)), -1)
            self._mark_dead(f"Worker rank {rank} (pid {self.pids[rank] if rank >= 0 else '?'}) died during "
                            f"{name}: {e}; the engine is dead. Start a new engine.")
            raise EngineDeadError(self.dead_reason) from None
        results = []
        for rank, (status, value) in enumerate(answers):
            if status == ERROR:
                self._raise_worker_error(name, rank, value)
            results.append(value)
        return results

    @staticmethod
    def _raise_worker_error(name: str, rank: int, remote_traceback: str) -> NoReturn:
        error = WorkerError(f"{name} failed on rank {rank}: {remote_traceback.strip().splitlines()[-1]}\n\n"
                            f"Traceback of rank {rank}:\n{remote_traceback}", rank, remote_traceback)
        raise error from RemoteTraceback(remote_traceback)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        self._kill_actors()

    def _kill_actors(self) -> None:
        ray = _import_ray()
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

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
                try:  # leave the process group and drop the model, as a WorkerProc does
                    ray.get([a.shutdown.remote() for a in self.actors], timeout=self.shutdown_grace_s)
                except Exception:  # noqa: BLE001 - a worker that cannot shut down is killed below
                    pass
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
