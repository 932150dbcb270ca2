"""import: importing the model's module does not initialize CUDA (or, strict, query it).

Runs with the CUDA guard on, in a fresh child of the warm parent (which never imported a model).
Failures that are not CUDA are reported as what they are: a missing dependency, an exception, a
missing class. Crashes, exits and hangs are reported by the runner from the process's fate.
"""

from __future__ import annotations

import importlib
import os
import time
import traceback
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.guard import CudaAccess, CudaGuard, find_holders, guarded_originals, libcuda_loaded

find_holders(guarded_originals())  # in the warm parent, once: every check's child reuses it


def trim_chain(access: CudaAccess, module: str) -> list[str]:
    """The import chain from the registered module down to the offender."""
    chain = access.chain
    return chain[chain.index(module):] if module in chain else chain


def _user_traceback(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename
              and not f.filename.startswith("<frozen") and "pytest_enginecheck" not in f.filename]
    return "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(exc))


def import_failure(ctx: CheckContext, exc: BaseException) -> CheckFailure:
    """An import's exception (not CUDA) as what it is: a missing dependency or module, an exit, an error."""
    module = ctx.module
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if missing and not (module == missing or module.startswith(missing + ".")):
        return CheckFailure(
            f"Importing {module} failed: it imports {missing!r}, which is not installed. Install it, or import "
            f"it lazily inside the code that needs it.",
            {"kind": "missing_dependency", "dependency": missing, "traceback": _user_traceback(exc)})
    if isinstance(exc, ModuleNotFoundError):
        return CheckFailure(
            f"Module {module!r} registered for {ctx.architecture} does not exist ({exc}); fix the registration.",
            {"kind": "module_not_found", "traceback": _user_traceback(exc)})
    if isinstance(exc, SystemExit):
        return CheckFailure(f"Importing {module} called sys.exit({exc.code!r}).",
                            {"kind": "exit", "code": exc.code, "traceback": _user_traceback(exc)})
    return CheckFailure(
        f"Importing {module} raised {type(exc).__name__}: {exc}",
        {"kind": "exception", "exception": type(exc).__name__, "traceback": _user_traceback(exc)})


def run(ctx: CheckContext) -> dict[str, Any]:
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # is_available() without cuInit, as in production
    driver_before = libcuda_loaded()
    error: BaseException | None = None
    start = time.perf_counter()
    with CudaGuard(strict=ctx.strict) as guard:
        try:
            module = importlib.import_module(ctx.module)
        except BaseException as e:  # noqa: BLE001 - classified below
            error = e
    seconds = time.perf_counter() - start
    accesses = sorted(guard.accesses, key=lambda a: a.kind != "init")
    if accesses:
        access = accesses[0]
        access.chain = trim_chain(access, ctx.module)
        verb = "queried CUDA" if access.kind == "query" else "touched CUDA"
        raise CheckFailure(
            f"Importing {ctx.module} {verb}: it {access.describe()}\n{access.fix_hint}",
            {**access.to_dict(), "kind": "cuda", "access": access.kind})
    if error is not None:
        raise import_failure(ctx, error)
    if not driver_before and libcuda_loaded():
        access = CudaAccess("cuInit", "driver", chain=[ctx.module])
        raise CheckFailure(f"Importing {ctx.module} {access.describe()}\n{access.fix_hint}",
                           {**access.to_dict(), "kind": "cuda", "access": access.kind})
    if not hasattr(module, ctx.class_name):
        raise CheckFailure(
            f"Module {ctx.module} imports cleanly but has no class {ctx.class_name!r}, which {ctx.architecture} "
            f"is registered as; fix the registration or define the class.",
            {"kind": "missing_class", "module": ctx.module, "class": ctx.class_name})
    return {"module": ctx.module, "import_seconds": round(seconds, 4)}
