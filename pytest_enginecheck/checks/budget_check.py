"""budget: each rank's weights, activation peak and KV cache fit the budget, and the meta-device
estimate equals the measurement; with --enginecheck-device-memory, the full-size model fits too.

The tiny checkpoint is started at TP=N with the budget as its device memory; the engine's
measured per-rank memory must equal ``engine_ref.memory.estimate`` for the same arguments
(weights and KV exactly, activations within one all-reduced activation at TP > 1). The full-size
prediction uses the architecture's ``reference_config`` (a published config.json).
"""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.budget import budget_violations
from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.checks.tiny_engine import DEVICE_MEMORY, MAX_MODEL_LEN, start_engine, tiny_checkpoint, verify_tp
from pytest_enginecheck.targets import engine_ref_registry


def _full_size(ctx: CheckContext, registry: Any) -> dict[str, Any]:
    from engine_ref.memory.estimate import estimate_memory
    from engine_ref.model_executor.models.interfaces import reference_config_path

    path = reference_config_path(registry.resolve_model_cls(ctx.architecture))
    if path is None:
        raise CheckSkip(f"{ctx.architecture} declares no reference_config (a full-size config.json), so its fit "
                        f"on a {ctx.device_memory} device cannot be predicted")
    estimate = estimate_memory(path, device_memory=ctx.device_memory, tensor_parallel_size=ctx.tp, registry=registry)
    if not estimate.fits:
        raise CheckFailure(
            f"The full-size {ctx.architecture} ({path.name}) does not fit a {ctx.device_memory} device at "
            f"tensor_parallel_size={ctx.tp}: {estimate.reason}",
            {"kind": "full_size", "config": path.name, "estimate": estimate.to_dict()})
    return {"config": path.name, "estimate": estimate.to_dict()}


def run(ctx: CheckContext) -> dict[str, Any]:
    from engine_ref.memory.compare import compare_with_report
    from engine_ref.memory.estimate import estimate_memory
    from engine_ref.utils import parse_size

    registry = engine_ref_registry(ctx.spec)
    ckpt = tiny_checkpoint(ctx, registry)
    verify_tp(ckpt, ctx.tp)
    with start_engine(ctx, ckpt, ctx.tp) as llm:
        report = llm.startup_report
    detail: dict[str, Any] = {"tensor_parallel_size": ctx.tp, "budget": DEVICE_MEMORY,
                              "memory_per_rank": [w.memory.to_dict() for w in report.workers]}
    violations = budget_violations(report, parse_size(DEVICE_MEMORY))
    if violations:
        raise CheckFailure(f"{ctx.architecture} at tensor_parallel_size={ctx.tp}: " + "; ".join(violations),
                           {**detail, "kind": "budget"})
    estimate = estimate_memory(ckpt, device_memory=DEVICE_MEMORY, tensor_parallel_size=ctx.tp,
                               max_model_len=MAX_MODEL_LEN, registry=registry)
    comparison = compare_with_report(estimate, report)
    detail["estimate"] = estimate.to_dict()
    if not comparison.ok:
        raise CheckFailure(
            f"The meta-device estimate of {ctx.architecture} at tensor_parallel_size={ctx.tp} differs from what "
            f"the engine measured: {comparison.describe()}", {**detail, "kind": "estimate_mismatch"})
    if ctx.device_memory:
        detail["full_size"] = _full_size(ctx, registry)
    return detail
