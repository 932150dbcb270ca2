"""The checks ``--enginecheck`` runs per architecture, each in its own warm child process.

A check is a function ``run(ctx: CheckContext) -> dict`` executed in the child: it returns the
result's ``detail`` when the architecture passes, raises CheckFailure with plain sentences (and
a detail dict) when it fails, or CheckSkip when the check does not apply. The child turns that
into the one CheckResult it sends back (``runner.run_in_child``); nothing else crosses over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHECKS = ("plugins", "import", "inspect", "load", "budget", "startup", "lora", "quant")
# The vLLM target's checks are ``pytest_enginecheck.vllm_adapter.checks.CHECK_FUNCTIONS`` (plugins: the module here).
CHECK_MODULES = {
    "plugins": "pytest_enginecheck.checks.plugins_check",
    "import": "pytest_enginecheck.checks.import_check",
    "inspect": "pytest_enginecheck.checks.inspect_check",
    "load": "pytest_enginecheck.checks.load_check",
    "budget": "pytest_enginecheck.checks.budget_check",
    "startup": "pytest_enginecheck.checks.startup_check",
    "lora": "pytest_enginecheck.checks.lora_check",
    "quant": "pytest_enginecheck.checks.quant_check",
}
TP_CHECKS = ("load", "budget", "lora", "quant")  # one item per TP size (quant: per method and TP size)
# One root cause, one failure: every check of an architecture imports its module (the root: the import
# item), and these also build and start it (the root: the load[tp=1] item).
BUILD_CHECKS = ("load", "budget", "startup", "lora", "quant")
BUILD_ROOT = "load[tp=1]"


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
    budget_memory: str = "512MiB"  # the budget check's tiny engine: device size, utilisation, max_model_len
    budget_utilization: float = 0.9
    budget_max_model_len: int = 128
    plugin: str = ""  # the plugins check: the entry point's name (``module`` is its module)
    quantization: str | None = None  # the quant check: the method (``--enginecheck-quant``)
    inspect_mode: str = "fork"  # the vLLM target's inspect check: "fork" or "subprocess" (``--enginecheck-inspect``)


def item_name(ctx: CheckContext) -> str:
    """The item's name and its result's ``check``: ``load[tp=2]`` for a TP check (``quant[fp8,tp=2]``), else the
    check."""
    if ctx.check not in TP_CHECKS:
        return ctx.check
    method = "" if ctx.quantization is None else f"{ctx.quantization},"
    return f"{ctx.check}[{method}tp={ctx.tp}]"


def roots(ctx: CheckContext) -> tuple[str, ...]:
    """The item names (of the same architecture) whose failure causes this item's, in the order to blame them."""
    name = item_name(ctx)
    found = () if ctx.check in ("import", "plugins") else ("import",)
    if ctx.check not in BUILD_CHECKS or name == BUILD_ROOT:
        return found
    tp = ctx.tp if ctx.check in TP_CHECKS else max(ctx.tp_sizes)  # startup runs at the largest TP size
    same_tp = f"load[tp={tp}]"  # a build that fails only at TP=N: load[tp=N] names the layer
    return (*found, BUILD_ROOT, *((same_tp,) if tp > 1 and same_tp != name else ()))


class CheckFailure(Exception):
    """The architecture failed the check (raised by the check in its child, and by its item); ``str(self)`` is
    what the user reads."""

    def __init__(self, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message, detail)
        self.message = message
        self.detail = detail or {}

    def __str__(self) -> str:
        return self.message


class CheckSkip(Exception):
    """The check does not apply to this architecture (the message says why)."""


@dataclass(frozen=True)
class CheckResult:
    """One item's outcome: what the child sends back, the item reports, the table and JSON show."""

    arch: str
    check: str  # the item name (see item_name)
    outcome: str  # "passed" | "failed" | "skipped"
    duration_s: float
    message: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # seconds: "process" and "check", engine phases

    def to_dict(self) -> dict[str, Any]:
        """The result as a JSON object (the user property of the item and an entry of the JSON report)."""
        return {"arch": self.arch, "check": self.check, "outcome": self.outcome,
                "duration_s": round(self.duration_s, 4), "phases": {k: round(v, 4) for k, v in self.phases.items()},
                "message": self.message, "detail": self.detail}

    def longrepr(self) -> str:
        """What a failure reads as: its sentences, then the child's traceback where one helps."""
        trace = self.detail.get("traceback")
        return f"{self.message}\n\n{trace}" if trace and self.detail.get("kind") != "cuda" else self.message
