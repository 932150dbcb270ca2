"""Runs a check in a warm child process and turns whatever happened into a CheckResult.

This is the pytest process's side: it imports no torch and no engine, only the warm-process
mechanism. A crash, an early exit or a hang of the child is described as what it was, in the
terms of the check (importing a module that segfaults is not a CUDA problem).
"""

from __future__ import annotations

import importlib
import time
from typing import Any

from engine_ref.isolation import ProcessCrashedError, ProcessTimeoutError, RemoteTraceback, run_isolated, tail

from pytest_enginecheck.checks import CHECK_MODULES, TP_CHECKS, CheckContext, CheckFailure, CheckResult, CheckSkip


def subject(ctx: CheckContext) -> str:
    """What the check was doing, as the start of a sentence."""
    return {
        "import": f"Importing {ctx.module}",
        "inspect": f"Inspecting {ctx.architecture}",
        "load": f"Loading {ctx.architecture} at tensor_parallel_size={ctx.tp}",
        "budget": f"Measuring the memory of {ctx.architecture} at tensor_parallel_size={ctx.tp}",
        "startup": f"Starting and stopping {ctx.architecture}",
    }[ctx.check]


def _run_in_child(ctx: CheckContext) -> dict[str, Any]:
    return importlib.import_module(CHECK_MODULES[ctx.check]).run(ctx)


def run_check(ctx: CheckContext) -> CheckResult:
    """Run one check in its own process tree, bounded by ``ctx.timeout``."""
    start = time.perf_counter()

    def result(outcome: str, message: str = "", detail: dict[str, Any] | None = None) -> CheckResult:
        name = f"{ctx.check}[tp={ctx.tp}]" if ctx.check in TP_CHECKS else ctx.check
        return CheckResult(ctx.architecture, name, outcome, time.perf_counter() - start, message, detail or {})

    try:
        detail = run_isolated(_run_in_child, ctx, timeout=ctx.timeout, name=f"enginecheck {ctx.check} {ctx.architecture}")
    except CheckSkip as e:
        return result("skipped", str(e))
    except CheckFailure as e:
        return result("failed", e.message, e.detail)
    except ProcessTimeoutError as e:
        return result("failed",
                      f"{subject(ctx)} did not finish within {ctx.timeout:g} s (--enginecheck-timeout); the check's "
                      f"process tree was killed. Its Python stacks at that moment:\n{e.stacks or '(none)'}",
                      {"kind": "timeout", "timeout_s": ctx.timeout, "stacks": e.stacks})
    except ProcessCrashedError as e:
        output = f" Its last output:\n{tail(e.output)}" if e.output.strip() else ""
        if e.signal_name:
            return result("failed", f"{subject(ctx)} crashed the process: it was killed by {e.signal_name}.{output}",
                          {"kind": "crash", "signal": e.signal_name, "output": e.output})
        return result("failed",
                      f"{subject(ctx)} ended the process with exit code {e.exitcode} (sys.exit, os._exit or exit() "
                      f"from native code) before the check finished.{output}",
                      {"kind": "exit", "exit_code": e.exitcode, "output": e.output})
    except Exception as e:  # noqa: BLE001 - an error of the check itself, not of the architecture
        remote = e.__cause__.text if isinstance(e.__cause__, RemoteTraceback) else ""
        return result("failed", f"{subject(ctx)} raised {type(e).__name__}: {e}",
                      {"kind": "error", "traceback": remote})
    return result("passed", detail=detail)
