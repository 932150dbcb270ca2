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


def import_failure(ctx: CheckContext, exc: BaseException) -> CheckFailure:
    """An import's exception (not CUDA) as what it is: a missing dependency or module, an exit, an error."""
    module = ctx.module
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if missing and not (module == missing or module.startswith(missing + ".")):
        return CheckFailure(
            f"Importing {module} failed: it imports {missing!r}, which is not installed. Install it, or import "
            f"it lazily inside the code that needs it.",
            {"kind": "missing_dependency", "dependency": missing, "traceback": user_traceback(exc)})
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
