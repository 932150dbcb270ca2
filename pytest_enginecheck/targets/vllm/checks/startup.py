"""startup on vLLM: vLLM starts and stops at the largest TP size, and nothing is left behind.
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
    if leaks:
        raise CheckFailure(f"{ctx.architecture} started and shut down at tensor_parallel_size={tp} ({args['dtype']}), "
                           f"but left behind: "
                           f"{'; '.join(leaks)}.", {"kind": "leak", "leaks": leaks})
    return {"tensor_parallel_size": tp, "dtype": args["dtype"], "seconds": run.seconds}
