"""budget[tp=N] on vLLM: each rank's weights, buffers, activation peak and one request's KV fit the budget.
"""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.targets.vllm.checks.steps import apart, engine_inputs, shared_run, verify_tp


def run_budget(ctx: CheckContext, mode: str = "warm") -> dict[str, Any]:
    """budget[tp=N]: each rank's weights, buffers, activation peak and one request's KV fit the budget."""
    from engine_ref.utils import format_bytes, parse_size

    ckpt, args = apart(ctx, engine_inputs)
    verify_tp(ckpt, ctx.tp)
    budget = ctx.options.budget_memory  # --enginecheck-budget-memory: each rank's device size
    run = shared_run(ctx, ckpt, ctx.tp, mode, args)
    limit = parse_size(budget)
    over = [m for m in run.memory if m["needs"] > limit]
    detail = {"tensor_parallel_size": ctx.tp, "dtype": args["dtype"], "budget": budget, "memory_per_rank": run.memory,
              "counted": "needs = weights + buffers + activation_peak + kv_one_request (kv_cache_allocated is what "
                         "vLLM allocated from VLLM_CPU_KVCACHE_SPACE, not what the model needs)"}
    if over:
        raise CheckFailure(f"{ctx.architecture} at tensor_parallel_size={ctx.tp} ({args['dtype']}): " + "; ".join(
            f"rank {m['rank']} needs {format_bytes(m['needs'])} (weights {format_bytes(m['weights'])}, activations "
            f"{format_bytes(m['activation_peak'])}, KV {format_bytes(m['kv_one_request'])} for one request of "
            f"max_model_len, buffers {format_bytes(m['buffers'])}) but the budget is {budget}" for m in over),
            {**detail, "kind": "budget"})
    return detail
