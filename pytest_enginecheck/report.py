"""The summary table (architecture x check) and the JSON report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pytest_enginecheck.checks import CHECKS

REPORT_VERSION = 1
_CELL = {"passed": "ok", "failed": "FAIL", "skipped": "skip"}


def _check_order(check: str) -> tuple[int, str]:
    base = check.split("[")[0]
    return (CHECKS.index(base) if base in CHECKS else len(CHECKS), check)


def summary_table(results: list[dict[str, Any]]) -> list[str]:
    """Rows of architectures (sorted), columns of checks in CHECKS order; '-' where a check did not run."""
    archs = sorted({r["arch"] for r in results})
    checks = sorted({r["check"] for r in results}, key=_check_order)
    cells = {(r["arch"], r["check"]): _CELL[r["outcome"]] for r in results}
    arch_width = max(len("architecture"), *(len(a) for a in archs))
    widths = [max(len(c), 4) for c in checks]
    header = f"{'architecture':<{arch_width}}  " + "  ".join(f"{c:<{w}}" for c, w in zip(checks, widths))
    lines = [header, "-" * len(header)]
    for arch in archs:
        lines.append(f"{arch:<{arch_width}}  " + "  ".join(
            f"{cells.get((arch, c), '-'):<{w}}" for c, w in zip(checks, widths)))
    counts = {outcome: sum(r["outcome"] == outcome for r in results) for outcome in _CELL}
    lines.append(f"{len(archs)} architectures: {counts['passed']} passed, {counts['failed']} failed, "
                 f"{counts['skipped']} skipped")
    return lines


def write_json(path: str | Path, target: str, results: list[dict[str, Any]]) -> None:
    """``{"version": 1, "target": ..., "results": [...]}``, written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"version": REPORT_VERSION, "target": target, "results": results}, indent=2) + "\n")
    tmp.replace(path)
