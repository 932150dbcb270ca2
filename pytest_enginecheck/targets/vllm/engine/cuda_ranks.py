"""--enginecheck-strict in vLLM's ranks: every warm rank, at every TP size, builds its model and runs its forwards
(the profile run where vLLM makes one, the requests, the checks' worker RPCs) under the checker's CUDA guard, and a
CUDA touch or query made by the MODEL's code ends the rank with a RankCudaFailure naming the rank, the call, the file
and the line (kind ``cuda_build`` or ``cuda_forward``, as engine_ref's ranks report theirs).

The mechanism, and why:

- Where: around ``drive`` in each warm rank (``ranks._rank_main``), the guard on from before vLLM's ``LLM`` is made
  until the rank has shut its engine down. Every TP size is covered because every rank is such a fork: TP=1 runs its
  engine core and its one worker in that process (``uni``), TP=N runs one ``external_launcher`` engine per rank. A
  variable (GUARD_VARIABLE, the model's module), set by the check around its start (``guarded_ranks``), reaches each
  fork; without --enginecheck-strict nothing is set and a rank pays one lookup of it.
- What fails: vLLM's own code, and the libraries it calls, ask about CUDA as they may, and must never fail a check
  (a clean TP=1 run of the fixed prompts makes some 180 such queries: Triton's driver probes, vLLM's sampler through
  dynamo's ``mark_unbacked``, torch's own context managers). So the guard attributes
  each access to its caller, the innermost frame outside torch (``guard.caller``, the frame the import guard names),
  and only an access whose caller is the model's code (``ModelCode``: the model class's module, the rest of an
  out-of-tree model's top-level package, or a file outside every installed library) is recorded and refused; any
  other runs torch's own function as if no guard were on, so vLLM behaves exactly as unguarded. An access vLLM
  makes on the model's behalf (a vLLM layer the model calls) is vLLM's, not the model's. The model's modules are
  first imported in the rank, under the guard (no process the ranks fork from imports them: ``checks.steps.apart``),
  so even a name bound at import (``from torch.cuda import is_available``) is the guard's.
- When: the stage comes from vLLM's worker functions on the stack at the access (``PHASES``): ``load_model`` (which
  builds the class and loads its weights) is ``build``; ``profile_run``, ``execute_model``, ``sample_tokens``
  (compute_logits) and the warm-up are ``forward``. The model's code running anywhere else in the rank (a config hook
  of its class while vLLM starts) is reported as ``build`` in phase ``startup``.
- Why not wrap the model class's ``__init__`` and ``forward``: that needs the class in the rank before vLLM imports
  it (importing the model's module before vLLM's CPU worker starts is what broke vLLM's kernel-rebinding scan, see
  ``checks.steps.apart``), and it would miss the model's other entry points (``load_weights``, ``compute_logits``,
  its layers' own ``forward``s, helpers they call). Attribution by frame needs no patch of vLLM or of the model.
- A query is refused at once like a touch (the engine_ref rank guard answers it and fails when the phase ends, a
  phase boundary vLLM gives no hook for): the verdict is the first access, and a query in forward would otherwise
  run the whole engine for nothing. The rank's verdict is what the guard recorded, whatever vLLM made of the refusal
  (an EngineDeadError, or nothing where the model swallowed it).

``spawn`` mode (``run.py``: vLLM's own engine-core process and spawned workers, the fallback for a warm-layout
artifact) is not guarded: those processes start fresh interpreters that run none of the checker's code. The variable
reaches them, unread; a start that fell back to spawn says so in its EngineRun's ``mode``.
"""

from __future__ import annotations

import contextlib
import os
import site
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any

from pytest_enginecheck.guard import CudaAccess, CudaGuard
from pytest_enginecheck.targets.vllm.failures import EngineFailure

# The model's module, set under --enginecheck-strict while a check starts vLLM: each warm rank reads it.
GUARD_VARIABLE = "ENGINECHECK_VLLM_CUDA_GUARD"
# vLLM's worker functions that begin a stage, innermost wins: name -> (stage, phase as reported)
PHASES = {
    "load_model": ("build", "load_model"),
    "profile_run": ("forward", "profile_run"),
    "determine_available_memory": ("forward", "determine_available_memory"),
    "compile_or_warm_up_model": ("forward", "compile_or_warm_up_model"),
    "execute_model": ("forward", "execute_model"),
    "sample_tokens": ("forward", "sample_tokens"),
}
OUTSIDE = ("build", "startup")  # the model's code ran in the rank outside load_model and the forwards
GUARD = "--enginecheck-strict's CUDA guard in every vLLM rank"
_NVML = ("vLLM sets PYTORCH_NVML_BASED_CUDA_CHECK=1 in its processes, so a query there runs no cuInit, but "
         "--enginecheck-strict fails it all the same: a model that decides by torch.cuda picks another device than the "
         "engine's (a CPU engine on a GPU host).")
BUILD_HINT = ("Take the device from the engine (the device of the layer's parameters, or vLLM's current_platform) "
              f"instead of naming or asking torch.cuda while the model is built. {_NVML}")
FORWARD_HINT = ("Take the device from the engine (the device of the layer's parameters or of its input) instead of "
                "naming or asking torch.cuda in the forward; a choice that depends on the device (a fused kernel) "
                f"belongs where vLLM's current_platform or the input's .device.type says \"cuda\". {_NVML}")


@contextlib.contextmanager
def guarded_ranks(module: str) -> Iterator[None]:
    """While a check starts vLLM: GUARD_VARIABLE set to ``module`` (the model's), put back as it was afterwards;
    nothing when ``module`` is empty (no --enginecheck-strict)."""
    if not module:
        yield
        return
    before = os.environ.get(GUARD_VARIABLE)
    os.environ[GUARD_VARIABLE] = module
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(GUARD_VARIABLE, None)
        else:
            os.environ[GUARD_VARIABLE] = before


def _package_dir(name: str) -> str | None:
    import importlib.util

    spec = importlib.util.find_spec(name)
    return os.path.dirname(spec.origin) + os.sep if spec is not None and spec.origin else None


# Where torch, Triton and vLLM write the Python code they generate (torch.compile's wrappers, Triton's launchers): a
# path with one of these in it is theirs, not the author's, though it lies outside every installed library.
GENERATED = ("torchinductor", f"{os.sep}.triton{os.sep}", "torch_compile_cache")


class ModelCode:
    """Whether a frame runs the model's code: a function of the model class's module (``module``), of another module
    of its top-level package when that package is not vLLM (an out-of-tree plugin's helpers), or of a file outside
    every library (torch, vLLM, the standard library, site-packages, this checker and engine_ref) and every cache of
    generated code (GENERATED, env.CACHE_VARIABLES): the author's own code on the path, wherever else it lives."""

    def __init__(self, module: str) -> None:
        from pytest_enginecheck.targets.vllm import ENGINE_PACKAGES
        from pytest_enginecheck.targets.vllm.env import CACHE_VARIABLES

        self.module = module
        top = module.partition(".")[0]
        self.package = "" if top in ENGINE_PACKAGES else top
        paths = sysconfig.get_paths()
        dirs = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
        dirs += [*site.getsitepackages(), site.getusersitepackages()]
        dirs += [d for name in ("torch", *ENGINE_PACKAGES, "pytest_enginecheck", "engine_ref")
                 if (d := _package_dir(name))]
        dirs += [os.environ[name] for name in CACHE_VARIABLES if os.environ.get(name)]
        self.libraries = tuple(d.rstrip(os.sep) + os.sep for d in dirs if d)

    def __call__(self, frame: FrameType) -> bool:
        name = str(frame.f_globals.get("__name__", ""))
        if name == self.module or (self.package and (name == self.package or name.startswith(self.package + "."))):
            return True
        file = frame.f_code.co_filename
        return (os.path.isabs(file) and not file.startswith(self.libraries)
                and not any(mark in file for mark in GENERATED))


def stage_of(frame: FrameType | None) -> tuple[str, str]:
    """(stage, phase) of the innermost vLLM worker function of PHASES on the stack from ``frame`` out; OUTSIDE
    where there is none."""
    while frame is not None:
        found = PHASES.get(frame.f_code.co_name)
        if found is not None and f"{os.sep}vllm{os.sep}" in frame.f_code.co_filename:
            return found
        frame = frame.f_back
    return OUTSIDE


@dataclass(frozen=True)
class RankCudaFailure(EngineFailure):
    """A rank's model touched or queried CUDA under the guard: ``access`` (CudaAccess.to_dict) in ``stage``
    (``build`` or ``forward``) during vLLM's ``phase``, on rank ``rank`` of ``world_size``."""

    access: dict[str, Any] = field(default_factory=dict)
    stage: str = "build"
    world_size: int = 1

    @property
    def cuda_access(self) -> CudaAccess:
        return CudaAccess(**self.access)


class RankGuard:
    """One rank's guard over its model's code (see the module docstring): a context manager around the rank's whole
    engine; ``failure()`` afterwards is the first touch the model made (else its first query), or None."""

    def __init__(self, module: str, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.is_model = ModelCode(module)
        self.stages: list[tuple[str, str]] = []  # per recorded access, in the guard's order
        self.guard = CudaGuard(strict=True, blames=self._blames)

    def _blames(self, frame: FrameType) -> bool:
        if not self.is_model(frame):
            return False
        self.stages.append(stage_of(frame))  # the guard records the access right after this answer
        return True

    def __enter__(self) -> RankGuard:
        self.guard.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.guard.__exit__(exc_type, exc, tb)

    def failure(self) -> RankCudaFailure | None:
        """What the model did first: its first touch (it would initialize CUDA), else its first query."""
        found = list(zip(self.guard.accesses, self.stages, strict=True))
        if not found:
            return None
        access, (stage, phase) = next((a for a in found if a[0].kind != "query"), found[0])
        verb = "queries CUDA" if access.kind == "query" else "touches CUDA"
        message = (f"rank {self.rank} of {self.world_size} {verb} in {stage} (vLLM's {phase}): "
                   f"{access.describe()}")
        where = f'  File "{access.file}", line {access.line}\n    {access.code or ""}' if access.file else ""
        return RankCudaFailure(phase, self.rank, f"CudaAccessError: {message}", where.rstrip(), "",
                               access=access.to_dict(), stage=stage, world_size=self.world_size)


def rank_guard(rank: int, world_size: int) -> RankGuard | None:
    """This rank's guard when the check asked for one (GUARD_VARIABLE), else None: the rank runs unguarded."""
    module = os.environ.get(GUARD_VARIABLE, "")
    return RankGuard(module, rank, world_size) if module else None
