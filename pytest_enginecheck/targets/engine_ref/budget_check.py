"""budget: each rank's weights, activation peak and KV cache fit the budget, at startup and while serving requests,
no memory grows from one round of requests to the next, and the meta-device estimate equals the measurement; with
--enginecheck-device-memory, the full-size model fits too.

The tiny checkpoint is started at TP=N with the budget as its device memory (and the budget's
gpu_memory_utilization and max_model_len: --enginecheck-budget-memory, -utilization, -max-model-len). Then it serves
a workload (``workload.py``): a batch of prompts of different lengths (a prefill, then decode steps), twice. Each
rank's peak, by category (weights, buffers, activations, one request's KV cache, other: what earlier steps still
hold), is held against the budget for its profile run, its prefill steps and its decode steps; what a rank holds
after the second round beyond what it held after the first is a per-request leak (the KV cache is allocated at
startup and written in place, so it is not that); at TP > 1 beyond one collective's tensor, which gloo may free a
moment late (``WorkloadRounds.late_release_bytes``, the detail's ``leak_tolerance``).

The engine's measured startup memory must equal ``engine_ref.memory.estimate`` for the same arguments (weights
and KV exactly, activations within one all-reduced activation at TP > 1). The estimate covers startup only (its
profile run): the workload's peaks are held against the budget, not against the estimate. The full-size
prediction uses the architecture's ``reference_config`` (a published config.json).
"""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.budget import budget_violations, describe_shortfall, per_request_leaks, workload_violations
from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.targets.engine_ref import cuda_ranks
from pytest_enginecheck.targets.engine_ref.registry import engine_ref_registry
from pytest_enginecheck.targets.engine_ref.tiny_engine import start_engine, tiny_checkpoint, verify_tp
from pytest_enginecheck.targets.engine_ref.workload import WorkloadRounds, run_workload


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


def _serve(ctx: CheckContext, llm: Any) -> WorkloadRounds | None:
    """The workload on the started engine; an engine error while serving it fails the check in the engine's words."""
    from engine_ref.errors import EngineRefError

    try:
        return run_workload(llm)
    except EngineRefError as e:
        found = cuda_ranks.guard_error(e)
        if found is None:
            raise CheckFailure(f"{ctx.architecture} at tensor_parallel_size={ctx.tp} started, then failed while "
                               f"serving the budget check's requests: {e}", {"kind": type(e).__name__}) from None
    raise cuda_ranks.cuda_failure(ctx, found)  # outside the except: its cause is its kind (cuda_ranks.cuda_failure)


def _check_workload(ctx: CheckContext, report: Any, served: WorkloadRounds, budget: int,
                    detail: dict[str, Any]) -> None:
    """Each rank's prefill and decode peaks fit the budget; nothing grows from the first round to the second."""
    violations = workload_violations(report, served.final, budget)
    if violations:
        raise CheckFailure(
            f"{ctx.architecture} at tensor_parallel_size={ctx.tp} fits the budget at startup but not while serving "
            f"requests: {'; '.join(violations)}. The engine reserves the profile run's activation peak (one prefill "
            f"of max_num_batched_tokens tokens, no KV cache) and gives the rest to the KV cache, so a step that "
            f"allocates more runs out of device memory once the KV cache is full: allocate no more in those steps "
            f"than the profile run does (or make the profile run allocate it too).", {**detail, "kind": "workload"})
    first, second = served.rounds[0], served.rounds[-1]
    leaks = per_request_leaks(first, second, served.late_release_bytes)
    if leaks:
        raise CheckFailure(
            f"{ctx.architecture} at tensor_parallel_size={ctx.tp} keeps memory from one request to the next: "
            f"{'; '.join(leaks)}. Both rounds ran the same requests, so a tensor a step created outlives it (kept on "
            f"a module, in a list or a cache that grows with every call): free it, or reuse one buffer.",
            {**detail, "kind": "per_request_leak"})


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
        served = _serve(ctx, llm)
    if served is None:
        detail["workload"] = f"not run: max_model_len={o.budget_max_model_len} leaves no room for a decode step"
    else:
        detail.update(workload_per_rank=[w.workload.to_dict() for w in served.final],
                      held_per_round=[[w.workload.held for w in reports] for reports in served.rounds],
                      leak_tolerance=served.late_release_bytes)
    estimate = estimate_memory(ckpt, device_memory=o.budget_memory, tensor_parallel_size=ctx.tp,
                               max_model_len=o.budget_max_model_len, gpu_memory_utilization=o.budget_utilization,
                               registry=registry)
    comparison = compare_with_report(estimate, report)
    detail["estimate"] = estimate.to_dict()
    if not comparison.ok:
        raise CheckFailure(
            f"The meta-device estimate of {ctx.architecture} at tensor_parallel_size={ctx.tp} differs from what "
            f"the engine measured: {comparison.describe()}", {**detail, "kind": "estimate_mismatch"})
    if served is not None:
        _check_workload(ctx, report, served, budget, detail)
    if o.device_memory:
        detail["full_size"] = _full_size(ctx, registry, o.device_memory)
    return detail
