"""The checks ``--enginecheck`` runs per architecture, each in its own warm child process.

A check is a function ``run(ctx: CheckContext) -> dict`` executed in the child: it returns the
result's ``detail`` when the architecture passes, raises CheckFailure with plain sentences (and
a detail dict) when it fails, or CheckSkip when the check does not apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHECKS = ("import", "inspect", "load", "budget", "startup")
CHECK_MODULES = {
    "import": "pytest_enginecheck.checks.import_check",
    "inspect": "pytest_enginecheck.checks.inspect_check",
    "load": "pytest_enginecheck.checks.load_check",
    "budget": "pytest_enginecheck.checks.budget_check",
    "startup": "pytest_enginecheck.checks.startup_check",
}
TP_CHECKS = ("load", "budget")  # one item per TP size


@dataclass(frozen=True)
class CheckContext:
    """Everything a check needs, sent to its child process."""

    check: str
    spec: str
    architecture: str
    module: str
    class_name: str
    workdir: str  # where checkpoints are generated, shared by the session's checks
    tp: int = 1
    tp_sizes: tuple[int, ...] = (1, 2)
    strict: bool = False
    device_memory: str | None = None
    timeout: float = 120.0


class CheckFailure(Exception):
    """The architecture failed the check; ``str(self)`` is what the user reads."""

    def __init__(self, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message, detail)
        self.message = message
        self.detail = detail or {}

    def __str__(self) -> str:
        return self.message


class CheckSkip(Exception):
    """The check does not apply to this architecture (the message says why)."""


@dataclass
class CheckResult:
    """One item's outcome, as it appears in the summary table and the JSON report."""

    arch: str
    check: str
    outcome: str  # "passed" | "failed" | "skipped"
    duration_s: float
    message: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"arch": self.arch, "check": self.check, "outcome": self.outcome,
                "duration_s": round(self.duration_s, 4), "message": self.message, "detail": self.detail}
