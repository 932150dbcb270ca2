"""Why a check failed, as one short string: the ``cause`` of every failed CheckResult (in its detail).

``runner.run_item`` folds a failing check into a failing root (``checks.roots``) only when both have the same
cause; otherwise both fail. The cause is the first of these that applies:

1. how a process ended, when the check's process or one below it died or hung: ``crash SIGSEGV``, ``exit 3``,
   ``timeout``;
2. ``import <module>``, when the failure happened while importing the architecture's module: a CUDA access in its
   import chain, a traceback frame running the body of the module (or of a package above it), a module or class
   that is not there;
3. the exception under the check's words: ``ValueError: rope_theta must be set`` (type and first line of its
   message, the first printed in the failure's traceback; a worker's own traceback when the engine relayed it);
4. the check's own finding, by its kind: ``leak``, ``tp_mismatch``.

So a module that fails its import fails every dependent the same way (2, or 1 for a crash, an exit, a hang), a
constructor that raises fails load, budget, startup, lora and quant with the same exception (3), whatever each check
wraps around it, and a leaked process (4) is not a sharding bug (4, or 3 when the engine raised).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure

_NOT_EXCEPTIONS = ("Traceback (most recent call last):", "During handling of the above exception",
                   "The above exception was the direct cause")
_PID = re.compile(r" ?\(pid \d+\)|(?<=pid )\d+")  # a worker's pid: the same failure has another one each run


def fate(detail: dict[str, Any], exc: BaseException | None = None) -> str | None:
    """How the check's process (the detail's kind) or a process below it (an IsolatedProcessError in the chain)
    ended, when it did not return: ``crash SIGSEGV``, ``exit 3``, ``timeout``."""
    from engine_ref.isolation import ProcessCrashedError, ProcessTimeoutError

    kind = detail.get("kind")
    if kind == "timeout":
        return "timeout"
    if kind == "crash":
        return f"crash {detail.get('signal')}"
    if kind == "exit":
        return f"exit {detail.get('exit_code', detail.get('code'))}"
    for e in _chain(exc):
        if isinstance(e, ProcessTimeoutError):
            return "timeout"
        if isinstance(e, ProcessCrashedError):
            return f"crash {e.signal_name}" if e.signal_name else f"exit {e.exitcode}"
    return None


def while_importing(ctx: CheckContext, texts: list[str], detail: dict[str, Any]) -> bool:
    """Whether the failure happened while importing ``ctx.module`` (or finding its class there)."""
    if detail.get("kind") == "cuda":
        return ctx.module in (detail.get("chain") or ())
    if detail.get("kind") in ("missing_class", "module_not_found"):
        return True
    parts = ctx.module.split(".")
    files = [*("/".join(parts[:i]) + "/__init__" for i in range(1, len(parts) + 1)), "/".join(parts)]
    frame = "|".join(re.escape(f).replace("/", r"[\\/]") for f in files)
    body = re.compile(rf'File "(?:[^"]*[\\/])?(?:{frame})\.py", line \d+,? in <module>')
    named = re.compile(rf"^\w*(?:Import|ModuleNotFound)Error: .*'{re.escape(ctx.module)}'", re.MULTILINE)
    return any(body.search(text) or named.search(text) for text in texts)


def first_exception(text: str) -> str | None:
    """The first exception a traceback's text prints (the root of what it shows): 'ValueError: bad shape'."""
    for line in text.splitlines():
        if line.strip() and not line[0].isspace() and not line.startswith(_NOT_EXCEPTIONS):
            return line.strip()
    return None


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and what it was raised from or while handling, as Python prints it; a CheckFailure (a check's own
    words around an error) always leads to the exception it was raised while handling."""
    while exc is not None:
        yield exc
        if exc.__cause__ is not None:
            exc = exc.__cause__
        elif isinstance(exc, CheckFailure) or not exc.__suppress_context__:
            exc = exc.__context__
        else:
            exc = None


def exception(detail: dict[str, Any], exc: BaseException | None) -> str | None:
    """The exception under the check's words: from the detail's traceback, else a relayed traceback (a worker's,
    an engine_ref RemoteTraceback) in the chain, else the innermost exception that is not a CheckFailure."""
    from engine_ref.isolation import RemoteTraceback

    if isinstance(detail.get("traceback"), str) and (line := first_exception(detail["traceback"])):
        return line
    innermost = None
    for e in _chain(exc):
        if isinstance(e, RemoteTraceback):
            return first_exception(e.text) or innermost
        if not isinstance(e, CheckFailure):
            lines = str(e).strip().splitlines()
            innermost = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return innermost


def failure_cause(ctx: CheckContext, message: str, detail: dict[str, Any], exc: BaseException | None = None) -> str:
    """The cause of a failure of ``ctx``'s check (see the module docstring); ``exc``: what the check raised."""
    texts = [message, *(v for k, v in detail.items() if k in ("traceback", "stacks", "output") and isinstance(v, str))]
    cause = fate(detail, exc)
    if cause is None and while_importing(ctx, texts, detail):
        cause = f"import {ctx.module}"
    if cause is None:
        cause = exception(detail, exc) or str(detail.get("kind") or "failed")
    return _PID.sub("", cause)


def same_cause(dependent: dict[str, Any], root: dict[str, Any]) -> bool:
    """Whether two failed results' details name the same cause (a result without one matches nothing)."""
    return dependent.get("cause") is not None and dependent.get("cause") == root.get("cause")
