"""What the driver and a rank's worker process say to each other, whatever runs the process (mp, ray).

A rank's host (a WorkerProc, a Ray actor) wraps one Worker: ``start_worker`` brings it through
init_worker -> init_device -> load_model, ``execute_method`` serves a call; each answers in the
shape of ``engine_ref.isolation.answer``: ``(OK, value)`` or ``(ERROR, Failure)``. The driver turns
an ERROR into WorkerStartupError or WorkerError naming the rank, with the rank's own traceback (raised from the
rank's CudaGuardError itself when ENGINE_REF_CUDA_GUARD failed it: engine_ref.worker.cuda_guard).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from engine_ref.config import EngineConfig
from engine_ref.errors import EngineDeadError, EngineRefError, WorkerStartupError
from engine_ref.isolation.answer import ERROR, OK, Answer, Failure
from engine_ref.worker.cuda_guard import CudaGuardError

if TYPE_CHECKING:
    from engine_ref.worker.worker import Worker

RpcMethod = str | Callable[..., Any]  # a Worker method's name, or fn(worker, *args, **kwargs)


class WorkerError(EngineRefError):
    """A worker raised while serving a call; the message and ``__cause__`` hold its traceback."""

    def __init__(self, message: str, rank: int, remote_traceback: str, type_name: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.type_name = type_name  # of the worker's exception: 'CollectiveTimeoutError'


class RpcTimeoutError(EngineDeadError, TimeoutError):
    """A call to the workers outlived its deadline (``rpc_timeout_s``): the engine is dead, its workers killed.

    ``ranks``: those that did not answer; ``stacks``: rank -> its Python stacks at the deadline.
    """

    def __init__(self, message: str, method: str, ranks: list[int], stacks: dict[int, str]) -> None:
        super().__init__(message)
        self.method, self.ranks, self.stacks = method, ranks, stacks


class WorkerWrapperBase:
    """One rank's Worker inside its process, driven by ``start_worker`` and ``execute_method``."""

    def __init__(self, config: EngineConfig, rank: int, distributed_init_method: str) -> None:
        self.config, self.rank = config, rank
        self.distributed_init_method = distributed_init_method
        self.phase = "init_worker"
        self.worker: Worker | None = None

    def start_worker(self) -> Answer:
        """init_worker -> init_device (joins the process group: waits for every rank) -> load_model."""
        from engine_ref.worker.worker import Worker

        try:
            self.worker = worker = Worker(self.config, self.rank, self.distributed_init_method)
            self.phase = "init_device"
            worker.init_device()
            self.phase = "load_model"
            worker.load_model()
        except BaseException as e:  # noqa: BLE001 - reported to the driver verbatim
            return ERROR, Failure.capture(e, phase=self.phase, keep_exception=isinstance(e, CudaGuardError))
        return OK, None

    def execute_method(self, method: RpcMethod, args: tuple, kwargs: dict[str, Any]) -> Answer:
        """Call a Worker method by name, or ``method(worker, *args, **kwargs)`` (as in vLLM)."""
        try:
            if isinstance(method, str):
                return OK, getattr(self.worker, method)(*args, **kwargs)
            return OK, method(self.worker, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the driver raises it, naming this rank
            return ERROR, Failure.capture(e, keep_exception=isinstance(e, CudaGuardError))

    def shutdown(self) -> None:
        """Leave the process group and drop the model."""
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None


def startup_error(rank: int, pid: int | None, what: str, failure: Failure | None = None) -> WorkerStartupError:
    """WorkerStartupError naming the rank; ``failure`` (the worker's own traceback) is its message's tail and cause."""
    message = f"Worker rank {rank} (pid {pid}) {what}"
    if failure is None:
        return WorkerStartupError(message)
    error = WorkerStartupError(f"{message}\n\nTraceback of rank {rank}:\n{failure.traceback}")
    error.__cause__ = rank_cause(failure)
    return error


def startup_failure(rank: int, pid: int | None, failure: Failure) -> WorkerStartupError:
    """The error for a rank that answered its startup with ERROR: 'failed in load_model: ...'."""
    return startup_error(rank, pid, f"failed in {failure.phase}: {failure.last_line}", failure)


def not_ready_error(stacks: Mapping[int, tuple[int | None, str]], timeout: float | None,
                    advice: str = "") -> WorkerStartupError:
    """The error for ranks not ready within ``timeout``; ``stacks``: rank -> (pid, its Python stacks)."""
    dumps = "\n".join(f"--- rank {rank} (pid {pid}) ---\n{text or '(none could be read)'}"
                      for rank, (pid, text) in stacks.items())
    were = "was" if len(stacks) == 1 else "were"
    return WorkerStartupError(
        f"Worker rank {', '.join(map(str, stacks))} {were} not ready within {timeout:g} s (ready_timeout_s / "
        f"ENGINE_REF_READY_TIMEOUT_S) and {were} killed. Raise ready_timeout_s if loading is only slow{advice}. "
        f"Python stacks at the timeout:\n{dumps}"
    )


def rpc_timeout_error(name: str, stacks: Mapping[int, tuple[int | None, str]], timeout: float | None,
                      errors: list[WorkerError], grace_s: float | None = None) -> RpcTimeoutError:
    """The error for ranks that did not answer ``name`` in time; ``stacks``: rank -> (pid, its stacks).

    ``errors``: what the other ranks raised meanwhile (their collective timing out while they waited for a
    stuck rank); with ``grace_s``, the wait ended that long after the first of them instead of at ``timeout``.
    """
    ranks = ", ".join(map(str, stacks))
    within = (f"within {grace_s:g} s after rank {errors[0].rank} raised" if errors and grace_s is not None
              else f"within {timeout:g} s (rpc_timeout_s / ENGINE_REF_RPC_TIMEOUT_S)")
    raised = "".join(f"\nRank {e.rank} raised meanwhile: {str(e).splitlines()[0]}" for e in errors)
    dumps = "\n".join(f"--- rank {rank} (pid {pid}) ---\n{text or '(none could be read)'}"
                      for rank, (pid, text) in stacks.items())
    return RpcTimeoutError(
        f"{name} did not finish on rank {ranks} {within}; the engine is dead and its workers were killed. Start a "
        f"new engine, and raise rpc_timeout_s if the call is only slow.{raised}\n"
        f"Python stacks at the timeout:\n{dumps}",
        name, list(stacks), {rank: text for rank, (_, text) in stacks.items()})


def worker_error(name: str, rank: int, failure: Failure) -> WorkerError:
    """The error for a rank that answered a call with ERROR."""
    error = WorkerError(f"{name} failed on rank {rank}: {failure.last_line}\n\n"
                        f"Traceback of rank {rank}:\n{failure.traceback}", rank, failure.traceback, failure.type_name)
    error.__cause__ = rank_cause(failure)
    return error


def rank_cause(failure: Failure) -> BaseException:
    """What the driver's error is raised from: the rank's CudaGuardError itself when it sent one (its traceback as its
    cause), so a caller finds the rank, file and line in the chain; else the rank's traceback."""
    remote = failure.remote_traceback()
    if failure.exception is None:
        return remote
    error: BaseException = pickle.loads(failure.exception)
    error.__cause__ = remote
    return error


def rpc_name(method: RpcMethod) -> str:
    """How messages name a call: the method's name, or the function's qualified name."""
    return method if isinstance(method, str) else getattr(method, "__qualname__", "a function")
