"""startup: full EngineCore startup and shutdown at the largest TP size that splits the model; every worker exits by
itself when asked (the process table is the oracle: none needed SIGTERM or SIGKILL, none left a non-daemon thread
running) and nothing is left behind. When no TP size splits it, the check is skipped."""

from __future__ import annotations

import dataclasses
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.leaks import ResourceSnapshot, wait_for_no_leaks, watch_only_this_engine
from pytest_enginecheck.targets.engine_ref.registry import engine_ref_registry
from pytest_enginecheck.targets.engine_ref.tiny_engine import start_engine, tiny_checkpoint, verify_tp

ADVICE = ("A worker must exit by itself once the engine shuts down: stop and join the threads the model starts "
          "(or make them daemon threads), and do not block its teardown.")


def run(ctx: CheckContext) -> dict[str, Any]:
    from engine_ref.executor.shutdown import describe_exits

    watch_only_this_engine(ctx.workdir)
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
    before = ResourceSnapshot.take(watch=True)
    with start_engine(ctx, ckpt, tp) as llm:
        report = llm.startup_report
    unclean = [end for end in llm.engine.worker_exits if not end.clean]
    leaks = wait_for_no_leaks(before)
    if unclean:
        left = f" It also left behind: {'; '.join(leaks)}." if leaks else ""
        how, stacks = describe_exits(unclean)
        raise CheckFailure(
            f"{ctx.architecture} started at tensor_parallel_size={tp}, but did not shut down cleanly: {how}.{left} "
            f"{ADVICE}"
            + (f"\nStacks:\n{stacks}" if stacks else ""),
            {"kind": "unclean_shutdown", "exits": [dataclasses.asdict(end) for end in unclean], "leaks": leaks,
             "thread_grace_s": llm.engine.executor.thread_grace_s})
    if leaks:
        raise CheckFailure(
            f"{ctx.architecture} started and shut down at tensor_parallel_size={tp}, but left behind: "
            f"{'; '.join(leaks)}.", {"kind": "leak", "leaks": leaks})
    return {"tensor_parallel_size": tp, "phases": report.phases,
            "worker_pids": [w.pid for w in report.workers]}
