"""The summary table (architecture x check) and the JSON report."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pytest_enginecheck.checks import CHECKS

REPORT_VERSION = 1
_CELL = {"passed": "ok", "failed": "FAIL", "skipped": "skip"}
LARGE = 400  # architectures from which the table lists failures first (and, by default, only them)


def _check_order(check: str) -> tuple[int, str]:
    base = check.split("[")[0]
    return (CHECKS.index(base) if base in CHECKS else len(CHECKS), check)


def summary_mode(requested: str | None, architectures: int) -> str:
    """``--enginecheck-summary`` as given, else all rows below LARGE architectures and failures from there."""
    return requested or ("all" if architectures < LARGE else "failures")


def summary_table(results: list[dict[str, Any]], mode: str = "all", others: Mapping[str, int] | None = None
                  ) -> list[str]:
    """Rows of architectures, columns of checks in CHECKS order ('-' where a check did not run), then the counts.

    ``mode`` "failures" lists only the rows with a failure, "all" every row (those with a failure first
    from LARGE architectures). ``others``: pytest's counts of the run's other tests, so that the two
    lines together agree with pytest's own.
    """
    archs = sorted({r["arch"] for r in results})
    failing = {r["arch"] for r in results if r["outcome"] == "failed"}
    shown = [a for a in archs if a in failing] if mode == "failures" else archs
    if mode == "all" and len(archs) >= LARGE:
        shown = [a for a in archs if a in failing] + [a for a in archs if a not in failing]
    checks = sorted({r["check"] for r in results}, key=_check_order)
    cells = {(r["arch"], r["check"]): _CELL[r["outcome"]] for r in results}
    arch_width = max(len("architecture"), *(len(a) for a in shown)) if shown else len("architecture")
    widths = [max(len(c), 4) for c in checks]
    header = f"{'architecture':<{arch_width}}  " + "  ".join(f"{c:<{w}}" for c, w in zip(checks, widths, strict=True))
    lines = [header, "-" * len(header)] if shown else []
    for arch in shown:
        lines.append(f"{arch:<{arch_width}}  " + "  ".join(
            f"{cells.get((arch, c), '-'):<{w}}" for c, w in zip(checks, widths, strict=True)))
    if len(shown) < len(archs):
        lines.append(f"({len(archs) - len(shown)} architectures without a failure not shown; "
                     f"--enginecheck-summary=all lists them)")
    counts = {outcome: sum(r["outcome"] == outcome for r in results) for outcome in _CELL}
    dependent = sum(r["outcome"] == "skipped" and r["detail"].get("kind") == "dependency" for r in results)
    because = f" ({dependent} because a check they depend on failed)" if dependent else ""
    line = (f"{len(archs)} architectures: {counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['skipped']} skipped{because}")
    rest = ", ".join(f"{n} {outcome}" for outcome, n in (others or {}).items() if n)
    lines.append(f"{line}; other tests: {rest}" if rest else line)
    return lines


def write_json(path: str | Path, target: str, results: list[dict[str, Any]]) -> None:
    """``{"version": 1, "target": ..., "results": [...]}``, written atomically (no temp file is left behind)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"version": REPORT_VERSION, "target": target, "results": results}, indent=2)
                       + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
