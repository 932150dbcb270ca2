"""The failures every target words the same way: a CUDA access at import (the API, file:line, the import chain),
an import that fails (a missing dependency, a module that is not there, an exit, an exception), a class missing
from its module, and the root line of a child's output. Targets build their CheckFailures here, so a verdict reads
the same whichever engine is checked.
"""

from __future__ import annotations

import traceback

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.guard import CudaAccess


def trim_chain(access: CudaAccess, module: str) -> list[str]:
    """The import chain from the registered module down to the offender."""
    chain = access.chain
    return chain[chain.index(module):] if module in chain else chain


def cuda_failure(what: str, access: CudaAccess, module: str) -> CheckFailure:
    """A guard verdict: ``what`` (``Importing pkg.model``) touched or queried CUDA, with the API, file:line and the
    import chain from ``module`` down."""
    access.chain = trim_chain(access, module)
    verb = "queried CUDA" if access.kind == "query" else "touched CUDA"
    return CheckFailure(f"{what} {verb}: it {access.describe()}\n{access.fix_hint}",
                        {**access.to_dict(), "kind": "cuda", "access": access.kind})


RANK_CUDA_KINDS = ("cuda_build", "cuda_forward")


def rank_cuda_failure(ctx: CheckContext, access: CudaAccess, stage: str, rank: int, world_size: int, phase: str,
                      guard: str, hint: str) -> CheckFailure:
    """A guard verdict from an engine's rank: its model touched or queried CUDA (``access``) while it was built
    (``stage="build"``) or in a forward (``"forward"``), on rank ``rank`` of ``world_size``, in the engine's ``phase``,
    under ``guard`` (what turned the guard on); kind ``cuda_build`` or ``cuda_forward``. Raise it outside the
    ``except`` that caught the engine's error: its cause (checks.causes) is then its kind, the same whichever rank,
    TP size or executor reported it, so the checks that repeat it fold into the first."""
    verb = "queries CUDA" if access.kind == "query" else "touches CUDA"
    if stage == "build":
        lead = f"imports cleanly but {verb} while it is built and loaded"
    else:
        lead = f"builds cleanly but {verb} in its forward"
    return CheckFailure(
        f"{ctx.architecture} {lead}: it {access.describe()}\nThat was rank {rank} of {world_size}, in {phase}, under "
        f"{guard}.\n{hint}",
        {**access.to_dict(), "kind": f"cuda_{stage}", "access": access.kind, "rank": rank, "world_size": world_size,
         "phase": phase})


def driver_failure(module: str) -> CheckFailure:
    """The CUDA driver got loaded while ``module`` imported, by a path the guard does not see (native code)."""
    access = CudaAccess("cuInit", "driver", chain=[module])
    return CheckFailure(f"Importing {module} {access.describe()}\n{access.fix_hint}",
                        {**access.to_dict(), "kind": "cuda", "access": access.kind})


def user_traceback(exc: BaseException) -> str:
    """``exc``'s traceback without the import machinery's and this plugin's frames."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename
              and not f.filename.startswith("<frozen") and "pytest_enginecheck" not in f.filename]
    return "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(exc))


# torch's companion packages: their PyPI wheels are built against PyPI's (CUDA) torch of the same release.
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def cpu_torch_companion(missing: str) -> str:
    """Why ``missing`` (a top-level module name) cannot simply be installed here: where it is one of torch's companion
    packages and the installed torch is the CPU build (``+cpu``), PyPI's wheels of it are built for PyPI's CUDA torch
    and break against this one ("operator torchvision::nms does not exist"). Empty where that is not the case."""
    from importlib.metadata import PackageNotFoundError, version

    if missing not in TORCH_COMPANIONS:
        return ""
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        return ""
    if not torch_version.endswith("+cpu"):
        return ""
    seen = " (\"operator torchvision::nms does not exist\")" if missing == "torchvision" else ""
    return (f"torch here is the CPU build ({torch_version}), and PyPI's {missing} wheels are built for PyPI's CUDA "
            f"torch: against this one they fail to load{seen}, so {missing} must be the CPU build of the matching "
            f"release, from https://download.pytorch.org/whl/cpu.")


def import_failure(ctx: CheckContext, exc: BaseException) -> CheckFailure:
    """An import's exception (not CUDA) as what it is: a missing dependency or module, an exit, an error."""
    module = ctx.module
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if missing and not (module == missing or module.startswith(missing + ".")):
        why = cpu_torch_companion(missing)
        fix = (f"{why} Install that build, or import it lazily inside the code that needs it." if why else
               "Install it, or import it lazily inside the code that needs it.")
        return CheckFailure(
            f"Importing {module} failed: it imports {missing!r}, which is not installed. {fix}",
            {"kind": "missing_dependency", "dependency": missing, "traceback": user_traceback(exc),
             **({"why": why} if why else {})})
    if isinstance(exc, ModuleNotFoundError):
        return CheckFailure(
            f"Module {module!r} registered for {ctx.architecture} does not exist ({exc}); fix the registration.",
            {"kind": "module_not_found", "traceback": user_traceback(exc)})
    if isinstance(exc, SystemExit):
        return CheckFailure(f"Importing {module} called sys.exit({exc.code!r}).",
                            {"kind": "exit", "code": exc.code, "traceback": user_traceback(exc)})
    return CheckFailure(
        f"Importing {module} raised {type(exc).__name__}: {exc}",
        {"kind": "exception", "exception": type(exc).__name__, "traceback": user_traceback(exc)})


def missing_class(ctx: CheckContext, module: str, class_name: str) -> CheckFailure:
    """The module imports but has no class by the name the architecture is registered as."""
    return CheckFailure(
        f"Module {module} imports cleanly but has no class {class_name!r}, which {ctx.architecture} is registered "
        f"as; fix the registration or define the class.",
        {"kind": "missing_class", "module": module, "class": class_name})


def root_line(output: str) -> str:
    """The line of a child's output that says what went wrong: a traceback's last line ('(no output)' if none)."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"
