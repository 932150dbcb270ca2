"""import on vLLM: the module imports and its class is found, with no CUDA.
"""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.targets.vllm import INSPECT
from pytest_enginecheck.targets.vllm.checks.inspect_check import store_inspection_apart
from pytest_enginecheck.targets.vllm.checks.steps import model_class, registry_entry


def run_import(ctx: CheckContext) -> dict[str, Any]:
    """import: the module imports and its class is found, with no CUDA (class lookup under the guard too).

    In fork mode, a clean import also builds the inspect check's verdict here (``_store_inspection``), so the
    architecture is imported by one fork for both checks."""
    from pytest_enginecheck.import_profile import PROFILE_TOP, ImportProfiler

    entry = registry_entry(ctx)
    with ImportProfiler() as profiler:
        try:
            model_cls = model_class(ctx, entry)
        except CheckFailure as failure:
            failure.detail["import_profile"] = profiler.top(PROFILE_TOP, root=entry.module)
            raise
    if INSPECT.value(ctx.options) == "fork":
        store_inspection_apart(ctx, entry, model_cls)
    return {"module": entry.module, "class": entry.class_name, "registered_as": entry.registered_as,
            "import_profile": profiler.top(PROFILE_TOP, root=entry.module)}
