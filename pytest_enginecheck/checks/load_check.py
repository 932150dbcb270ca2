"""load: the architecture builds and loads at TP=N on real CPU ranks, and TP=N output equals TP=1.

When TP=N disagrees with TP=1 (other tokens, or a start that fails where TP=1 starts), tp_diagnosis
names the first module whose output differs and whether its weights or its collective are wrong.
"""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.checks.tiny_engine import greedy, prompts, tiny_checkpoint, verify_tp
from pytest_enginecheck.targets import engine_ref_registry


def _diagnosis(ctx: CheckContext, ckpt: Any, prompt: list[int]) -> str | None:
    from pytest_enginecheck.checks.tp_diagnosis import diagnose

    try:
        return diagnose(ctx.spec, ckpt, ctx.tp, prompt, timeout=max(10.0, ctx.timeout * 0.4))
    except Exception:  # noqa: BLE001 - no diagnosis: the check's own finding stands
        return None


def run(ctx: CheckContext) -> dict[str, Any]:
    ckpt = tiny_checkpoint(ctx, engine_ref_registry(ctx.spec))
    verify_tp(ckpt, ctx.tp)
    try:
        outputs, report = greedy(ctx, ckpt, ctx.tp)
    except CheckFailure as failure:
        diagnosis = _diagnosis(ctx, ckpt, reference_prompt(ckpt, 1)) if ctx.tp > 1 else None
        if diagnosis is None:
            raise
        raise CheckFailure(f"{ctx.architecture} fails to start at tensor_parallel_size={ctx.tp}: {diagnosis}",
                           {**failure.detail, "kind": "tp_mismatch", "diagnosis": diagnosis}) from None
    detail: dict[str, Any] = {
        "tensor_parallel_size": ctx.tp,
        "bytes_read_per_rank": [w.bytes_read for w in report.workers],
        "load_seconds_per_rank": [round(w.phases.get("load_model", 0.0), 4) for w in report.workers],
    }
    if ctx.tp > 1:
        reference, _ = greedy(ctx, ckpt, 1)
        mismatched = [i for i, (a, b) in enumerate(zip(outputs, reference, strict=True)) if a != b]
        if mismatched:
            i = mismatched[0]
            diagnosis = _diagnosis(ctx, ckpt, reference_prompt(ckpt, i)) or (
                "Some weight is sharded or its collective is wrong. Check the weight_loader of the layers this "
                "model changed.")
            raise CheckFailure(
                f"At tensor_parallel_size={ctx.tp}, {ctx.architecture} generates different tokens than at "
                f"tensor_parallel_size=1 (prompt {i}: {outputs[i]} vs {reference[i]}). {diagnosis}",
                {**detail, "kind": "tp_mismatch", "outputs": outputs, "reference": reference,
                 "diagnosis": diagnosis})
    return detail


def reference_prompt(ckpt: Any, i: int) -> list[int]:
    """Prompt ``i`` of the fixed prompts, in the checkpoint's vocabulary."""
    import json

    config = json.loads((ckpt / "config.json").read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return prompts(vocab)[i]
