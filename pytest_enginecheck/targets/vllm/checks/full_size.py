"""budget[tp=N] on vLLM with ``--enginecheck-device-memory``: the architecture's full-size model fits that GPU too.

The full-size config.json is the one ``fit.full_size`` finds (``--enginecheck-full-size-configs``, else the class's
``enginecheck_full_size_config``); the prediction is ``fit.predict.predict_fit`` at the check's TP size with the
budget check's gpu_memory_utilization and max_model_len (``--enginecheck-budget-utilization``,
``--enginecheck-budget-max-model-len``), run in a fork of the check's process (it joins vLLM's distributed state,
which ranks forked later must not inherit). The check fails where max_model_len does not fit even with every GPU-only
term at the low end of its range; "may not fit" is kept in the detail, not failed (the range is an estimate's,
docs/fit.md). An architecture without a full-size config is not predicted, and its detail says how to give one.
"""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.targets.vllm.checks.steps import apart, model_class, registry_entry


def full_size_fit(ctx: CheckContext) -> dict[str, Any]:
    """The full-size prediction for budget[tp=N] (run in a fork of the check's process): its detail, or a
    CheckFailure when max_model_len does not fit ``--enginecheck-device-memory`` at the check's TP size."""
    return apart(ctx, _predict_in_fork)


def _predict_in_fork(ctx: CheckContext) -> dict[str, Any]:
    from pytest_enginecheck.targets.vllm.fit import FitError
    from pytest_enginecheck.targets.vllm.fit.engine_config import ServeArgs
    from pytest_enginecheck.targets.vllm.fit.full_size import (
        FULL_SIZE_ATTRIBUTE,
        FULL_SIZE_CONFIGS,
        FullSizeConfigError,
        full_size_config,
        parse_mapping,
    )
    from pytest_enginecheck.targets.vllm.fit.predict import predict_fit
    from pytest_enginecheck.targets.vllm.fit.report import render

    device = str(ctx.options.device_memory)
    try:
        mapping = parse_mapping(FULL_SIZE_CONFIGS.value(ctx.options))
        # the class (for its declaration) only where the option names no config: importing it costs seconds
        model_cls = None if ctx.architecture in mapping else model_class(ctx, registry_entry(ctx))
        path = full_size_config(ctx.architecture, mapping, model_cls)
    except FullSizeConfigError as e:
        raise CheckFailure(str(e), {"kind": "full_size_config"}) from None
    if path is None:
        return {"predicted": False, "why": f"no full-size config.json is known for {ctx.architecture}: give it with "
                                           f"--enginecheck-full-size-configs or the class's {FULL_SIZE_ATTRIBUTE}"}
    args = ServeArgs(tensor_parallel_size=ctx.tp, max_model_len=ctx.options.budget_max_model_len,
                     gpu_memory_utilization=ctx.options.budget_utilization)
    try:
        report = predict_fit(path, device, args, try_sizes=())
    except FitError as e:
        raise CheckFailure(f"The full-size {ctx.architecture} ({path}) cannot be predicted on a {device} GPU at "
                           f"tensor_parallel_size={ctx.tp}: {e}", {"kind": "full_size", "config": str(path)}) from None
    detail = {"predicted": True, "config": str(path), "verdict": report.verdict, "prediction": report.to_dict()}
    if report.verdict == "does not fit":
        raise CheckFailure(f"The full-size {ctx.architecture} ({path}) does not fit a {device} GPU at "
                           f"tensor_parallel_size={ctx.tp} and max_model_len={report.max_model_len} (vLLM's own "
                           f"model and sizing, predicted on the CPU):\n{render(report)}",
                           {"kind": "full_size", **detail})
    return detail
