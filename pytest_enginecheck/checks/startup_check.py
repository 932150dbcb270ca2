"""startup: full EngineCore startup and shutdown at the largest TP size that splits the model; nothing is left
behind. When no TP size splits it, the check is skipped."""

from __future__ import annotations

import contextlib
import ctypes
import os
import tempfile
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.checks.tiny_engine import start_engine, tiny_checkpoint, verify_tp
from pytest_enginecheck.leaks import ResourceSnapshot, wait_for_no_leaks
from pytest_enginecheck.targets import engine_ref_registry


def watch_only_this_engine(workdir: str) -> None:
    """Make what this check process and its workers leave behind findable, and only that.

    A private temp dir: the shared one also receives other processes' entries (another xdist
    worker's engines, other jobs). Child subreaper: a process a worker started and left running
    is re-parented to this process instead of init, so it is still found among our descendants.
    """
    os.environ["TMPDIR"] = tempfile.mkdtemp(dir=workdir, prefix=".startup-tmp-")
    tempfile.tempdir = None
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER (Linux)


def run(ctx: CheckContext) -> dict[str, Any]:
    watch_only_this_engine(ctx.workdir)
    ckpt = tiny_checkpoint(ctx, engine_ref_registry(ctx.spec))
    reasons = []
    for tp in sorted(ctx.tp_sizes, reverse=True):
        try:
            verify_tp(ckpt, tp)
            break
        except CheckSkip as e:
            reasons.append(str(e))
    else:
        raise CheckSkip(f"no tensor_parallel_size of --enginecheck-tp={','.join(map(str, ctx.tp_sizes))} splits "
                        f"{ctx.architecture}: " + " ".join(reasons))
    before = ResourceSnapshot.take()
    with start_engine(ctx, ckpt, tp) as llm:
        report = llm.startup_report
    leaks = wait_for_no_leaks(before)
    if leaks:
        raise CheckFailure(
            f"{ctx.architecture} started and shut down at tensor_parallel_size={tp}, but left behind: "
            f"{'; '.join(leaks)}.", {"kind": "leak", "leaks": leaks})
    return {"tensor_parallel_size": tp, "phases": report.phases,
            "worker_pids": [w.pid for w in report.workers]}
