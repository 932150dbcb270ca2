"""--enginecheck-strict in the engine's ranks: every engine a check starts builds and runs its model, in every rank's
process and at every TP size, under engine_ref's own CUDA guard, and a rank that touches or queries CUDA fails the
check naming the rank, the call, the file and the line: kind ``cuda_build`` (while its model is built) or
``cuda_forward`` (in a forward: the profile run at startup, or a request).

The checker's CudaGuard (pytest_enginecheck.guard) guards only this process (the import, load_check.tp1_model): a
TP=N engine builds and runs its model in processes of its own. So the checker asks the engine, as a user would,
with ENGINE_REF_CUDA_GUARD=strict (engine_ref.worker.cuda_guard: why an engine option and not a general plugin),
set while the engine starts, which is when each rank reads it; a rank's CudaGuardError comes back through the
engine's errors (raised as is by the uni executor, as the cause of WorkerStartupError or WorkerError by the others).
Without --enginecheck-strict nothing is set and nothing is guarded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.checks.failures import RANK_CUDA_KINDS, rank_cuda_failure

if TYPE_CHECKING:
    from engine_ref.worker.cuda_guard import CudaGuardError

KINDS = RANK_CUDA_KINDS
BUILD_HINT = ("Take the device from the engine (the device of the layer's parameters or of its input) instead of "
              "asking torch.cuda while the model is built, or run with PYTORCH_NVML_BASED_CUDA_CHECK=1 so a query "
              "uses NVML instead of cuInit.")
FORWARD_HINT = ("Take the device from the engine (the device of the layer's parameters or of its input) instead of "
                "naming or asking torch.cuda in the forward; a choice that depends on the device (a fused kernel) "
                "belongs where the input's .device.type says \"cuda\".")


@contextlib.contextmanager
def guarded_ranks(strict: bool) -> Iterator[None]:
    """While an engine starts: ENGINE_REF_CUDA_GUARD=strict when ``strict``, put back as it was afterwards; nothing
    otherwise. Each rank reads it when it is created (the uni executor's here, a WorkerProc from the environment it
    inherits) and keeps its guard for the engine's life."""
    if not strict:
        yield
        return
    from engine_ref.envs import CUDA_GUARD_VARIABLE

    before = os.environ.get(CUDA_GUARD_VARIABLE)
    os.environ[CUDA_GUARD_VARIABLE] = "strict"
    try:
        yield
    finally:
        if before is None:
            del os.environ[CUDA_GUARD_VARIABLE]
        else:
            os.environ[CUDA_GUARD_VARIABLE] = before


def guard_error(error: BaseException) -> CudaGuardError | None:
    """The rank's CudaGuardError: ``error`` itself, or what it was raised from."""
    from engine_ref.worker.cuda_guard import CudaGuardError

    seen: BaseException | None = error
    while seen is not None and not isinstance(seen, CudaGuardError):
        seen = seen.__cause__
    return seen


def cuda_failure(ctx: CheckContext, error: CudaGuardError) -> CheckFailure:
    """The check's failure for a rank's CudaGuardError: ``cuda_build`` or ``cuda_forward``, with the access as the
    detail (as load_check.tp1_model reports its own build's). Raise it outside the ``except`` that caught the engine's
    error: its cause (checks.causes) is then its kind, the same whichever rank, TP size or executor reported it, so
    the checks that repeat it fold into the first."""
    from pytest_enginecheck.guard import CudaAccess

    access = CudaAccess(error.api, error.access, error.file, error.line, error.code)
    return rank_cuda_failure(ctx, access, error.stage, error.rank, error.world_size, error.phase,
                             "ENGINE_REF_CUDA_GUARD=strict (set by --enginecheck-strict)",
                             BUILD_HINT if error.stage == "build" else FORWARD_HINT)


def generate(ctx: CheckContext, llm: Any, *args: Any, **kwargs: Any) -> list[list[int]]:
    """``llm.generate(*args, **kwargs)``; a rank's CudaGuardError fails the check as ``cuda_forward``, any other error
    goes on as it is."""
    from engine_ref.errors import EngineRefError

    try:
        tokens: list[list[int]] = llm.generate(*args, **kwargs)
        return tokens
    except EngineRefError as e:
        found = guard_error(e)
        if found is None:
            raise
    raise cuda_failure(ctx, found)
