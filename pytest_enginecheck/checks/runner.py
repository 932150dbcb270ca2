"""Runs a check in a warm child process; the child sends back its CheckResult.

``run_in_child`` is the child's side: it turns what the check returned or raised into the result.
``run_check`` is the pytest process's side: it imports no torch and no engine, only the
warm-process mechanism, and describes a crash, an early exit or a hang of the child as what it
was, in the terms of the check (importing a module that segfaults is not a CUDA problem).
``run_item`` adds the dependencies: a failure whose root (``checks.roots``) failed for the same cause
(``checks.causes``: the same import, the same exception, the same process fate or finding) is a skip that
names the root, so one root cause reads as one failure; a failure of its own stays a failure, with one line
saying that the root failed too.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Mapping, MutableMapping
from typing import Any

from engine_ref.isolation import ProcessCrashedError, ProcessTimeoutError, last_call_stats, run_isolated, tail
from engine_ref.isolation.tempdirs import mkdtemp_beside
from pytest_enginecheck.checks import (
    CheckContext,
    CheckFailure,
    CheckResult,
    CheckSkip,
    item_name,
    plugins_check,
    subject,
)
from pytest_enginecheck.checks.causes import failure_cause, same_cause
from pytest_enginecheck.checks.measurements import cache_counts, with_cache_counts, with_call_stats
from pytest_enginecheck.targets import CheckFunction, load_target


def _result(ctx: CheckContext, outcome: str, message: str = "", detail: dict[str, Any] | None = None,
            exc: BaseException | None = None) -> CheckResult:
    """The result of ``ctx``'s item (a failure with its ``cause``, from ``exc``: what the check raised);
    ``run_check`` sets its duration."""
    detail = detail or {}
    if outcome == "failed":
        detail = {**detail, "cause": failure_cause(ctx, message, detail, exc)}
    return CheckResult(ctx.architecture, item_name(ctx), outcome, 0.0, message, detail)


def _error(ctx: CheckContext, e: Exception) -> CheckResult:
    """An exception of the check's own code or of the process mechanism, with its traceback."""
    return _result(ctx, "failed", f"{subject(ctx)} raised {type(e).__name__}: {e}",
                   {"kind": "error", "traceback": traceback.format_exc()}, e)


def _phases(seconds: float, detail: dict[str, Any]) -> dict[str, float]:
    """The check's own time and, where it started an engine, the engine's startup phases."""
    engine = detail.get("phases")
    engine = engine if isinstance(engine, dict) else {}
    return {"check": seconds, **{f"engine.{name}": float(s) for name, s in engine.items() if isinstance(s, float)}}


def check_function(ctx: CheckContext) -> CheckFunction:
    """The function that runs ``ctx``'s check: the core's plugins check on every target (it loads the plugins through
    the target's ``plugin_loader``), else its target's (``Target.check_function``)."""
    if ctx.check == "plugins":
        return plugins_check.run
    return load_target(ctx.spec).check_function(ctx.check)


def run_in_child(ctx: CheckContext, tmpdir: str | None = None) -> CheckResult:
    """Run the check here (in its child process): passed with its detail, failed, or skipped.

    ``tmpdir``: this child's private TMPDIR (what libraries leave there at import, which a normal interpreter
    exit would remove and ``os._exit`` does not, goes with it: ``run_check`` removes it).
    """
    if tmpdir is not None:
        os.environ["TMPDIR"] = tempfile.tempdir = tmpdir
    start = time.perf_counter()
    cached = cache_counts(ctx)
    try:
        detail = check_function(ctx)(ctx)
    except CheckSkip as e:
        result = _result(ctx, "skipped", str(e))
    except CheckFailure as e:
        result = _result(ctx, "failed", e.message, e.detail, e)
    except Exception as e:  # noqa: BLE001 - an error of the check itself, not of the architecture
        result = _error(ctx, e)
    else:
        result = _result(ctx, "passed", detail=detail)
    result = with_cache_counts(ctx, result, cached)
    return dataclasses.replace(result, phases=_phases(time.perf_counter() - start, result.detail))


def run_check(ctx: CheckContext) -> CheckResult:
    """Run one check in its own process tree, bounded by ``ctx.options.timeout``."""
    start = time.perf_counter()
    private = mkdtemp_beside("check")  # directly in the temp dir: short enough for the Unix sockets made in it
    try:
        result = run_isolated(run_in_child, ctx, private, timeout=ctx.options.timeout,
                              name=f"enginecheck {ctx.check} {ctx.architecture}")
    except ProcessTimeoutError as e:
        result = _result(ctx, "failed",
                         f"{subject(ctx)} did not finish within {ctx.options.timeout:g} s (--enginecheck-timeout); the "
                         f"check's process tree was killed. Its Python stacks at that moment:\n{e.stacks or '(none)'}",
                         {"kind": "timeout", "timeout_s": ctx.options.timeout, "stacks": e.stacks})
    except ProcessCrashedError as e:
        output = f" Its last output:\n{tail(e.output)}" if e.output.strip() else ""
        if e.signal_name:
            result = _result(ctx, "failed",
                             f"{subject(ctx)} crashed the process: it was killed by {e.signal_name}.{output}",
                             {"kind": "crash", "signal": e.signal_name, "output": e.output})
        else:
            result = _result(ctx, "failed",
                             f"{subject(ctx)} ended the process with exit code {e.exitcode} (sys.exit, os._exit or "
                             f"exit() from native code) before the check finished.{output}",
                             {"kind": "exit", "exit_code": e.exitcode, "output": e.output})
    except Exception as e:  # noqa: BLE001 - the child could not be started or its result not read
        result = _error(ctx, e)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    result = with_call_stats(result, last_call_stats())
    duration = time.perf_counter() - start
    # "process": starting the child and reading its answer back, around the check itself (all of it when the
    # child died or hung before answering).
    phases = {"process": max(0.0, duration - result.phases.get("check", 0.0)), **result.phases}
    return dataclasses.replace(result, duration_s=duration, phases=phases)


def failed(result: CheckResult) -> bool:
    """Whether the check failed: a failure, or one folded into its root's (a root folded into its own root counts
    as failed for its dependents, as it does when it is rerun in another pytest-xdist worker)."""
    return result.outcome == "failed" or result.detail.get("kind") == "dependency"


def run_item(ctx: CheckContext, roots: Mapping[str, tuple[str, CheckContext]],
             known: MutableMapping[str, CheckResult]) -> CheckResult:
    """Run ``ctx``'s check; when it fails for the cause a root of it failed for, skip it, naming the root.

    ``roots``: item name -> (node id, context) of the roots selected in this run, in the order to blame
    them. ``known``: item name -> result of this architecture's items known in this process (those run
    here, and the roots rerun here). A root unknown here ran in another pytest-xdist worker, or not yet:
    it is rerun here (failures only, so a passing run pays nothing), and both ways give the same verdict.

    The rule: a dependent is folded into the first failed root with the same ``cause`` (``checks.causes``:
    a module that does not import, the same exception, the same process fate, the same finding). A
    dependent that failed for a cause of its own stays failed, and its message gets one more line naming
    the roots that failed too. A check that passes passes, whatever its roots did.
    """
    result = run_check(ctx)
    if result.outcome == "failed":
        failed_too = []
        for name, (nodeid, root) in roots.items():
            if name not in known:
                known[name] = run_check(root)
            if not failed(known[name]):
                continue
            if same_cause(result.detail, known[name].detail):
                result = dataclasses.replace(
                    result, outcome="skipped", message=f"{name} failed, see {nodeid}",
                    detail={"kind": "dependency", "root": nodeid, "failure": result.message,
                            "cause": result.detail.get("cause")})
                break
            failed_too.append((name, nodeid))
        else:
            if failed_too:
                names, nodeids = (", ".join(x) for x in zip(*failed_too, strict=True))
                result = dataclasses.replace(result, message=f"{result.message}\n({names} failed too, see {nodeids}.)")
    known[item_name(ctx)] = result
    return result
