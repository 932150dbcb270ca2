"""startup: full EngineCore startup, requests (the fixed prompts: prefill, then decode steps) and shutdown at the
largest TP size that splits the model; every worker exits by itself when asked (the process table is the oracle:
none needed SIGTERM or SIGKILL, none left a non-daemon thread running) and nothing is left behind. When no TP size
splits it, the check is skipped.

What the engine left is judged as for every engine a check starts (leftovers.reported_after, around this function):
a thread or a process started only at the first decode step is found because the engine runs requests first.
"""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckSkip
from pytest_enginecheck.targets.engine_ref.registry import engine_ref_registry
from pytest_enginecheck.targets.engine_ref.tiny_engine import greedy, tiny_checkpoint, verify_tp


def run(ctx: CheckContext) -> dict[str, Any]:
    ckpt = tiny_checkpoint(ctx, engine_ref_registry(ctx.spec))
    reasons = []
    for tp in sorted(ctx.options.tp_sizes, reverse=True):
        try:
            verify_tp(ckpt, tp)
            break
        except CheckSkip as e:
            reasons.append(str(e))
    else:
        sizes = ",".join(map(str, ctx.options.tp_sizes))
        raise CheckSkip(f"no tensor_parallel_size of --enginecheck-tp={sizes} splits {ctx.architecture}: "
                        + " ".join(reasons))
    _, report = greedy(ctx, ckpt, tp)
    return {"tensor_parallel_size": tp, "phases": report.phases,
            "worker_pids": [w.pid for w in report.workers]}
