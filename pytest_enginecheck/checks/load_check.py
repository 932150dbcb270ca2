"""load: the architecture builds and loads at TP=N on real CPU ranks, and TP=N output equals TP=1."""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.checks.tiny_engine import greedy, tiny_checkpoint, verify_tp
from pytest_enginecheck.targets import engine_ref_registry


def run(ctx: CheckContext) -> dict[str, Any]:
    ckpt = tiny_checkpoint(ctx, engine_ref_registry(ctx.spec))
    verify_tp(ckpt, ctx.tp)
    outputs, report = greedy(ctx, ckpt, ctx.tp)
    detail: dict[str, Any] = {
        "tensor_parallel_size": ctx.tp,
        "bytes_read_per_rank": [w.bytes_read for w in report.workers],
        "load_seconds_per_rank": [round(w.phases.get("load_model", 0.0), 4) for w in report.workers],
    }
    if ctx.tp > 1:
        reference, _ = greedy(ctx, ckpt, 1)
        mismatched = [i for i, (a, b) in enumerate(zip(outputs, reference)) if a != b]
        if mismatched:
            i = mismatched[0]
            raise CheckFailure(
                f"At tensor_parallel_size={ctx.tp}, {ctx.architecture} generates different tokens than at "
                f"tensor_parallel_size=1 (prompt {i}: {outputs[i]} vs {reference[i]}): some weight is sharded "
                f"or its collective is wrong. Check the weight_loader of the layers this model changed.",
                {**detail, "kind": "tp_mismatch", "outputs": outputs, "reference": reference})
    return detail
