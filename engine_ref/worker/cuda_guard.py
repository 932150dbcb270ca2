"""ENGINE_REF_CUDA_GUARD=strict: every rank builds and runs its model under a CUDA guard.

On a CPU engine a model must neither touch CUDA nor ask about it. ``x.cuda()`` fails on a CPU-only torch with an
AssertionError that says nothing of where the model went wrong, and initializes CUDA on a GPU host;
``torch.cuda.is_available()`` and ``device_count()`` run cuInit on a GPU host (unless
``PYTORCH_NVML_BASED_CUDA_CHECK=1``), after which forked workers cannot use CUDA. A CPU CI machine sees neither.
Under the guard, a worker's ``load_model`` (the build) and its ``profile_run`` and ``execute_model`` (the forwards)
fail with CudaGuardError naming the rank, the call, and the file and line of the code that made it. It travels the
engine's own error path: the uni executor raises it as is; a WorkerProc or a Ray actor sends it to the driver, which
raises WorkerStartupError (startup) or WorkerError (a request) from it (engine_ref.executor.protocol).

Why an engine option, read from the environment like vLLM's ``VLLM_*`` variables, rather than a general plugin that
a checker installs (engine_ref.plugins): the guard must wrap exactly the build and the forwards of each rank and fail
through the engine's errors, which a plugin (run once per process, filtered by ENGINE_REF_PLUGINS) could only do by
patching the worker, and only in the processes where plugins load. A variable reaches every rank (each WorkerProc
inherits the environment of the engine that starts it; the uni executor's rank reads it in that process), costs an
unguarded engine one lookup per worker, and works without pytest (a CPU CI job sets it). engine_ref owns this guard
and never imports pytest_enginecheck; pytest-enginecheck's ``--enginecheck-strict`` sets the variable.

How: every CUDA-initializing path in torch calls the Python function ``torch.cuda._lazy_init``, looked up at call
time, so replacing it (in every torch module that holds it) catches ``.cuda()``, ``.to("cuda")`` and every factory
given a CUDA device; what a CPU build refuses before reaching it (``set_device``, ``Stream``, ``pin_memory``...) is
replaced too, so a CPU machine reports what a GPU host would have initialized. A touch raises at once; a query is
recorded and answered, and the phase fails when it ends (so does a touch the model swallowed).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

from engine_ref import envs
from engine_ref.errors import ConfigError, EngineRefError

if TYPE_CHECKING:
    from engine_ref.config import EngineConfig

# On a CUDA build these initialize CUDA; on a CPU build they fail before reaching _lazy_init.
EARLY_FAILING_FUNCTIONS = (
    "set_device", "stream", "get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all",
    "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_accumulated_memory_stats", "ipc_collect",
)
EARLY_FAILING_CLASSES = ("Stream", "Event", "ExternalStream", "device")
QUERY_FUNCTIONS = ("is_available", "device_count")
BUILD_PHASES = ("load_model",)  # the others (profile_run, execute_model) run a forward


class CudaGuardError(EngineRefError):
    """Under ENGINE_REF_CUDA_GUARD=strict, a rank's model touched (``access="init"``) or queried (``"query"``)
    CUDA in ``phase``: ``api`` at ``file``:``line``."""

    def __init__(self, rank: int, world_size: int, phase: str, api: str, access: str, file: str | None = None,
                 line: int | None = None, code: str | None = None) -> None:
        self.rank, self.world_size, self.phase = rank, world_size, phase
        self.api, self.access, self.file, self.line, self.code = api, access, file, line, code
        super().__init__(self._message())

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.rank, self.world_size, self.phase, self.api, self.access, self.file, self.line,
                            self.code)

    @property
    def stage(self) -> str:
        """``build`` (load_model) or ``forward`` (profile_run, execute_model)."""
        return "build" if self.phase in BUILD_PHASES else "forward"

    def _message(self) -> str:
        where = f"{_shown(self.file)}:{self.line}" if self.file else "an unknown place"
        code = f" (`{self.code}`)" if self.code else ""
        head = f"rank {self.rank} of {self.world_size}"
        fix = "Take the device from the engine (a parameter's or the input's .device)"
        if self.access == "query":
            return (f"{head} queries CUDA in {self.stage} ({self.phase}): {self.api}() at {where}{code}. On a GPU "
                    f"host that runs cuInit (unless PYTORCH_NVML_BASED_CUDA_CHECK=1), after which forked workers "
                    f"cannot use CUDA. {fix} instead of asking torch.cuda, or unset {envs.CUDA_GUARD_VARIABLE}.")
        return (f"{head} touches CUDA in {self.stage} ({self.phase}): {self.api} at {where}{code}, on a "
                f"CPU engine (it would initialize CUDA on a GPU host). {fix} instead of naming cuda.")


def _shown(file: str) -> str:
    """``file`` relative to the working directory when it is below it (``zoo/model.py``), else as it is."""
    relative = os.path.relpath(file)
    return file if relative.startswith(os.pardir) else relative


def worker_cuda_guard(config: EngineConfig, rank: int) -> WorkerCudaGuard | None:
    """The guard of rank ``rank`` when ENGINE_REF_CUDA_GUARD asks for one, else None (the engine runs unguarded)."""
    if envs.cuda_guard() is None:
        return None
    if config.device_config.device == "cuda":
        raise ConfigError(f"{envs.CUDA_GUARD_VARIABLE}=strict checks that a CPU engine's model never touches CUDA, "
                          f"but this engine runs on device='cuda'; use device='cpu', or unset "
                          f"{envs.CUDA_GUARD_VARIABLE}.")
    return WorkerCudaGuard(rank, config.parallel_config.world_size)


class WorkerCudaGuard:
    """One rank's guard: ``with guard.phase("load_model"):`` runs the body with torch's CUDA entry points replaced,
    and raises CudaGuardError for the first touch (else the first query) the body made."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        found: list[CudaGuardError] = []
        saved = self._install(name, found)
        try:
            yield
        except CudaGuardError:
            raise
        except BaseException as e:
            if found:  # the model swallowed the guard's error and failed on, or failed after a query
                raise _first(found) from e
            raise
        finally:
            for owner, attr, value in reversed(saved):
                setattr(owner, attr, value)
        if found:
            raise _first(found)

    def _error(self, phase: str, api: str | None, access: str, frame: FrameType | None) -> CudaGuardError:
        file, line, code, api = _locate(api, frame)
        return CudaGuardError(self.rank, self.world_size, phase, api, access, file, line, code)

    def _install(self, phase: str, found: list[CudaGuardError]) -> list[tuple[Any, str, Any]]:
        """Replace every guarded torch.cuda attribute in every torch module that holds it, and Tensor.pin_memory;
        return what to put back."""
        import torch

        guard = self

        def touched(api: str | None) -> Any:
            def refuse(*args: Any, **kwargs: Any) -> Any:
                found.append(guard._error(phase, api, "init", sys._getframe(1)))
                raise found[-1]
            return refuse

        def queried(name: str, original: Any) -> Any:
            def query(*args: Any, **kwargs: Any) -> Any:
                found.append(guard._error(phase, f"torch.cuda.{name}", "query", sys._getframe(1)))
                return original(*args, **kwargs)
            return query

        cuda = torch.cuda
        replacements: dict[str, tuple[Any, Any]] = {"_lazy_init": (cuda._lazy_init, touched(None))}
        for name in EARLY_FAILING_FUNCTIONS:
            if (original := getattr(cuda, name, None)) is not None:
                replacements[name] = (original, touched(f"torch.cuda.{name}"))
        for name in EARLY_FAILING_CLASSES:
            if isinstance(original := getattr(cuda, name, None), type):
                hook = "__enter__" if name == "device" else "__new__"  # making a device selects nothing
                replacements[name] = (original, type(name, (original,), {hook: touched(f"torch.cuda.{name}"),
                                                                          "__module__": original.__module__}))
        for name in QUERY_FUNCTIONS:
            replacements[name] = (getattr(cuda, name), queried(name, getattr(cuda, name)))
        saved: list[tuple[Any, str, Any]] = [(torch.Tensor, "pin_memory", torch.Tensor.pin_memory)]
        torch.Tensor.pin_memory = touched("torch.Tensor.pin_memory")  # type: ignore[method-assign]
        for module, name in _holders({name: original for name, (original, _) in replacements.items()}):
            original, replacement = replacements[name]
            if module.__dict__.get(name) is original:
                saved.append((module, name, original))
                setattr(module, name, replacement)
        return saved


def _first(found: list[CudaGuardError]) -> CudaGuardError:
    """The first touch, else the first query."""
    return next((e for e in found if e.access == "init"), found[0])


_holders_cache: dict[tuple[str, ...], list[tuple[Any, str]]] = {}


def _holders(originals: dict[str, Any]) -> list[tuple[Any, str]]:
    """(module, name) of every loaded torch module that holds ``originals[name]`` under ``name``, read from its
    ``__dict__`` (torch.ops makes a namespace of any attribute asked of it). Cached per set of loaded torch modules:
    a forward runs under the guard at every step."""
    modules = tuple(name for name in sys.modules if name.startswith("torch"))
    holders = _holders_cache.get(modules)
    if holders is None:
        holders = []
        for module_name in modules:
            namespace = getattr(sys.modules[module_name], "__dict__", None) or {}
            holders += [(sys.modules[module_name], name) for name in originals.keys() & namespace.keys()
                        if namespace[name] is originals[name]]
        _holders_cache[modules] = holders
    return holders


def _locate(api: str | None, frame: FrameType | None) -> tuple[str | None, int | None, str | None, str]:
    """The file, line and source of the first frame outside torch and this module, from ``frame`` (the replaced
    function's caller) outwards; and ``api``, or when None (``_lazy_init``, reached from C++ or from a torch
    function) the torch function the code called, else the call its line makes (``Tensor.cuda``)."""
    import linecache

    import torch

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    inner: FrameType | None = None
    while frame is not None and (frame.f_code.co_filename.startswith(torch_dir)
                                 or frame.f_code.co_filename == __file__):
        inner, frame = frame, frame.f_back
    if frame is None:
        return None, None, None, api or "a CUDA tensor operation"
    file, line = frame.f_code.co_filename, frame.f_lineno
    code = linecache.getline(file, line).strip() or None
    if api is None:
        api = _public_name(inner) if inner is not None else _guess_api(code)
    return file, line, code, api


def _public_name(frame: FrameType) -> str:
    """``torch.cuda.mem_get_info``, not the ``torch.cuda.memory.mem_get_info`` torch.cuda re-exports."""
    name, module = frame.f_code.co_name, str(frame.f_globals.get("__name__", "torch"))
    exported = getattr(sys.modules.get("torch.cuda"), name, None)
    if module.startswith("torch.cuda.") and getattr(exported, "__code__", None) is frame.f_code:
        module = "torch.cuda"
    return f"{module}.{name}"


def _guess_api(code: str | None) -> str:
    """The call on a line of the model's code that reached CUDA from C++ (``x.cuda()``, ``torch.zeros(...)``)."""
    for pattern, name in ((r"\.cuda\(", "Tensor.cuda"), (r"\.to\(", "Tensor.to"), (r"\b(torch(?:\.\w+)+)\s*\(", None)):
        if code and (match := re.search(pattern, code)):
            return name or match.group(1)
    return "a CUDA tensor operation"
