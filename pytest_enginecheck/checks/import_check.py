"""import: importing the model's module does not initialize CUDA (or, strict, query it). A target whose
architectures are a module and a class (engine_ref's, SGLang's) runs this check as it is.

Runs with the CUDA guard on, in a fresh child of the warm parent (which never imported a model).
Failures that are not CUDA are reported as what they are: a missing dependency, an exception, a
missing class. Crashes, exits and hangs are reported by the runner from the process's fate.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

from pytest_enginecheck.checks import CheckContext
from pytest_enginecheck.checks.failures import cuda_failure, driver_failure, import_failure, missing_class
from pytest_enginecheck.guard import CudaGuard, find_holders, guarded_originals, libcuda_loaded
from pytest_enginecheck.targets import load_target

find_holders(guarded_originals())  # in the warm parent, once: every check's child reuses it


def run(ctx: CheckContext) -> dict[str, Any]:
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # is_available() without cuInit, as in production
    driver_before = libcuda_loaded()
    from pytest_enginecheck.checks import CheckFailure
    from pytest_enginecheck.import_profile import PROFILE_TOP, ImportProfiler

    error: BaseException | None = None
    start = time.perf_counter()
    with (CudaGuard(strict=ctx.options.strict, engine_packages=load_target(ctx.spec).engine_packages) as guard,
          ImportProfiler() as profiler):
        try:
            module = importlib.import_module(ctx.module)
        except BaseException as e:  # noqa: BLE001 - classified below
            error = e
    seconds = time.perf_counter() - start
    profile = profiler.top(PROFILE_TOP, root=ctx.module)  # failures carry it too: what ran before the failure
    try:
        accesses = sorted(guard.accesses, key=lambda a: a.kind != "init")
        if accesses:
            raise cuda_failure(f"Importing {ctx.module}", accesses[0], ctx.module)
        if error is not None:
            raise import_failure(ctx, error)
        if not driver_before and libcuda_loaded():
            raise driver_failure(ctx.module)
        if not hasattr(module, ctx.class_name):
            raise missing_class(ctx, ctx.module, ctx.class_name)
    except CheckFailure as failure:
        failure.detail["import_profile"] = profile
        raise
    return {"module": ctx.module, "import_seconds": round(seconds, 4), "import_profile": profile}
