"""startup on vLLM: vLLM starts, generates and stops at the largest TP size; every rank exits by itself (the process
table is the oracle: none had to be killed after the shutdown grace) and nothing is left behind.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.targets.vllm.checks.steps import apart, engine_inputs, fits, start


def run_startup(ctx: CheckContext, mode: str = "warm") -> dict[str, Any]:
    """startup: vLLM starts and stops at the largest TP size; no process, fd, temp entry or shm segment is left."""
    from pytest_enginecheck.leaks import ResourceSnapshot, wait_for_no_leaks, watch_only_this_engine

    ckpt, args = apart(ctx, engine_inputs)
    tp = max(t for t in (*ctx.options.tp_sizes, 1) if t == 1 or fits(ckpt, t))
    # vLLM binds ZeroMQ IPC sockets in (each rank's private dir in) TMPDIR: keep the path short of the
    # 107-byte socket limit by creating the check's private TMPDIR directly in /tmp.
    watch_only_this_engine("/tmp" if os.path.isdir("/tmp") else ctx.workdir)
    private = os.environ["TMPDIR"]
    try:
        before = ResourceSnapshot.take(watch=True)
        run = start(ctx, ckpt, tp, mode, args)
        leaks = wait_for_no_leaks(before, ignore_regular_files=True)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    if run.killed_ranks:
        raise _killed(ctx, tp, args["dtype"], run.killed_ranks, leaks)
    if leaks:
        raise CheckFailure(f"{ctx.architecture} started and shut down at tensor_parallel_size={tp} ({args['dtype']}), "
                           f"but left behind: "
                           f"{'; '.join(leaks)}.", {"kind": "leak", "leaks": leaks})
    return {"tensor_parallel_size": tp, "dtype": args["dtype"], "seconds": run.seconds}


def _killed(ctx: CheckContext, tp: int, dtype: str, killed: list[dict[str, Any]], leaks: list[str]) -> CheckFailure:
    """The failure of ranks that answered but did not exit within the shutdown grace: their stacks name what kept
    them alive (a non-daemon thread the model started, which the interpreter's exit waits for)."""
    from pytest_enginecheck.targets.vllm.engine.ranks import SHUTDOWN_GRACE_S

    ranks = ", ".join(str(k["rank"]) for k in killed)
    left = f" It also left behind: {'; '.join(leaks)}." if leaks else ""
    stacks = "\n".join(f"rank {k['rank']}:\n{k['stacks'].rstrip()}" for k in killed)
    return CheckFailure(
        f"{ctx.architecture} started, generated and shut down at tensor_parallel_size={tp} ({dtype}), but rank "
        f"{ranks} did not exit by itself within {SHUTDOWN_GRACE_S:g} s and was killed.{left} A rank must exit once "
        f"vLLM shuts down: stop and join the threads the model starts (or make them daemon threads). Its Python "
        f"stacks before the kill (a non-daemon thread of the model's is what keeps it alive):\n{stacks}",
        {"kind": "unclean_shutdown", "killed_ranks": killed, "leaks": leaks, "grace_s": SHUTDOWN_GRACE_S})
