"""budget: each rank's weights, activation peak and KV cache fit the budget, and the meta-device
estimate equals the measurement; with --enginecheck-device-memory, the full-size model fits too.

The tiny checkpoint is started at TP=N with the budget as its device memory (and the budget's
gpu_memory_utilization and max_model_len: --enginecheck-budget-memory, -utilization, -max-model-len); the engine's
measured per-rank memory must equal ``engine_ref.memory.estimate`` for the same arguments
(weights and KV exactly, activations within one all-reduced activation at TP > 1). The full-size
prediction uses the architecture's ``reference_config`` (a published config.json).
"""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.budget import budget_violations, describe_shortfall
from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.targets.engine_ref.registry import engine_ref_registry
from pytest_enginecheck.targets.engine_ref.tiny_engine import start_engine, tiny_checkpoint, verify_tp


def _too_big(ctx: CheckContext, shortfalls: list[str], detail: dict[str, Any]) -> CheckFailure:
    """The tiny checkpoint does not fit the budget check's device: the model's example_config is what to change."""
    o = ctx.options
    return CheckFailure(
        f"The tiny checkpoint of {ctx.architecture} (made from its example_config) does not fit the budget check's "
        f"device at tensor_parallel_size={ctx.tp}: {'; '.join(shortfalls)}. Shrink example_config (fewer layers, a "
        f"smaller hidden_size, intermediate_size or vocab_size) so the tiny model fits {o.budget_memory} per rank "
        f"at gpu_memory_utilization={o.budget_utilization:g} and max_model_len={o.budget_max_model_len} "
        f"(--enginecheck-budget-memory, --enginecheck-budget-utilization, --enginecheck-budget-max-model-len).",
        {**detail, "kind": "budget"})


def _full_size(ctx: CheckContext, registry: Any, device_memory: str) -> dict[str, Any]:
    from engine_ref.memory.estimate import estimate_memory
    from engine_ref.model_executor.models.interfaces import reference_config_path

    path = reference_config_path(registry.resolve_model_cls(ctx.architecture))
    if path is None:
        raise CheckSkip(f"{ctx.architecture} declares no reference_config (a full-size config.json), so its fit "
                        f"on a {device_memory} device cannot be predicted")
    estimate = estimate_memory(path, device_memory=device_memory, tensor_parallel_size=ctx.tp, registry=registry)
    if not estimate.fits:
        raise CheckFailure(
            f"The full-size {ctx.architecture} ({path.name}) does not fit a {device_memory} device at "
            f"tensor_parallel_size={ctx.tp}: {estimate.reason}",
            {"kind": "full_size", "config": path.name, "estimate": estimate.to_dict()})
    return {"config": path.name, "estimate": estimate.to_dict()}


def run(ctx: CheckContext) -> dict[str, Any]:
    from engine_ref.errors import KVCacheTooSmallError
    from engine_ref.memory.compare import compare_with_report
    from engine_ref.memory.estimate import estimate_memory
    from engine_ref.utils import parse_size

    o = ctx.options
    registry = engine_ref_registry(ctx.spec)
    ckpt = tiny_checkpoint(ctx, registry)
    verify_tp(ckpt, ctx.tp)
    budget = parse_size(o.budget_memory)
    detail: dict[str, Any] = {"tensor_parallel_size": ctx.tp, "budget": o.budget_memory,
                              "gpu_memory_utilization": o.budget_utilization, "max_model_len": o.budget_max_model_len}
    try:
        llm = start_engine(ctx, ckpt, ctx.tp, device_memory=o.budget_memory,
                           gpu_memory_utilization=o.budget_utilization, max_model_len=o.budget_max_model_len)
    except CheckFailure as e:  # start_engine's, with the engine's own error as its context
        refused = e.__context__
        if isinstance(refused, KVCacheTooSmallError) and refused.shortfall is not None:
            raise _too_big(ctx, [describe_shortfall(refused.shortfall, budget, o.budget_max_model_len)], detail
                           ) from None
        raise
    with llm:
        report = llm.startup_report
    detail.update(memory_per_rank=[w.memory.to_dict() for w in report.workers], phases=report.phases)
    violations = budget_violations(report, budget)
    if violations:
        raise _too_big(ctx, violations, detail)
    estimate = estimate_memory(ckpt, device_memory=o.budget_memory, tensor_parallel_size=ctx.tp,
                               max_model_len=o.budget_max_model_len, gpu_memory_utilization=o.budget_utilization,
                               registry=registry)
    comparison = compare_with_report(estimate, report)
    detail["estimate"] = estimate.to_dict()
    if not comparison.ok:
        raise CheckFailure(
            f"The meta-device estimate of {ctx.architecture} at tensor_parallel_size={ctx.tp} differs from what "
            f"the engine measured: {comparison.describe()}", {**detail, "kind": "estimate_mismatch"})
    if o.device_memory:
        detail["full_size"] = _full_size(ctx, registry, o.device_memory)
    return detail
