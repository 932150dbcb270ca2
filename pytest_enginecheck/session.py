"""EngineCheckSession: the plugin object ``--enginecheck`` registers (pytest-memray style).

It describes the target (in a child process), generates the items at collection, gathers each
item's result from its report (so it works under pytest-xdist, where items run in workers), and
closes the run with the summary table and the JSON report.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest

from pytest_enginecheck.checks import CHECKS, TP_CHECKS, CheckContext
from pytest_enginecheck.items import RESULT_PROPERTY, EngineCheckCollector
from pytest_enginecheck.options import Settings
from pytest_enginecheck.report import summary_table, write_json
from pytest_enginecheck.targets import ArchEntry, TargetDescription

DESCRIBE_TIMEOUT_S = 300.0
# What every check child imports: preloaded once in the warm parent instead of once per check.
CHILD_MODULES = ("pytest_enginecheck.checks.runner", "pytest_enginecheck.checks.import_check",
                 "pytest_enginecheck.checks.inspect_check", "pytest_enginecheck.targets", "pytest_enginecheck.leaks")


class EngineCheckSession:
    """Generates the check items of one pytest run and reports their results."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        from engine_ref.isolation import add_preload_modules
        from pytest_enginecheck.targets import TARGET_PRELOAD

        add_preload_modules(*CHILD_MODULES, *TARGET_PRELOAD.get(settings.target, ()))
        if settings.trace_dir:  # the check children inherit it: each engine start writes its trace there
            os.makedirs(settings.trace_dir, exist_ok=True)
            os.environ["ENGINE_REF_TRACE_DIR"] = settings.trace_dir
        self.config = config
        self.settings = settings
        self.results: list[dict[str, Any]] = []
        self._workdir: str | None = None

    @property
    def is_xdist_worker(self) -> bool:
        return hasattr(self.config, "workerinput")

    def describe_target(self) -> TargetDescription:
        """The target's architectures, resolved in a child process (the pytest process stays light)."""
        from engine_ref.isolation import run_isolated
        from pytest_enginecheck.targets import TargetError, describe

        try:
            return run_isolated(describe, self.settings.target, timeout=DESCRIBE_TIMEOUT_S,
                                name="enginecheck describe target")
        except TargetError as e:
            raise pytest.UsageError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - the target's own failure, told plainly
            raise pytest.UsageError(
                f"--enginecheck-target={self.settings.target!r} could not be loaded: {type(e).__name__}: {e}"
            ) from None

    def select_checks(self, description: TargetDescription) -> tuple[str, ...]:
        """The checks to run, in CHECKS order: those asked for, or all that apply to the target."""
        applicable = description.checks
        if self.settings.checks is None:
            return tuple(c for c in CHECKS if c in applicable)
        refused = [c for c in self.settings.checks if c not in applicable]
        if refused:
            raise pytest.UsageError(
                f"--enginecheck-checks: {', '.join(refused)} cannot run on a {description.kind} target "
                f"(only {', '.join(applicable)}); point --enginecheck-target at an engine_ref ModelRegistry.")
        return tuple(c for c in CHECKS if c in self.settings.checks)

    @property
    def workdir(self) -> str:
        if self._workdir is None:
            from engine_ref.isolation.tempdirs import owner_dir

            # In this process's own temp dir: a killed pytest run's checkpoints are swept at the next start.
            self._workdir = tempfile.mkdtemp(prefix="enginecheck-", dir=owner_dir())
        return self._workdir

    def contexts(self, entry: ArchEntry, checks: tuple[str, ...]) -> list[CheckContext]:
        """One context per item of ``entry``: per check, and per TP size for TP_CHECKS."""
        s = self.settings
        return [CheckContext(check=check, spec=s.target, architecture=entry.architecture, module=entry.module,
                             class_name=entry.class_name, workdir=self.workdir, tp=tp, tp_sizes=s.tp_sizes,
                             strict=s.strict, device_memory=s.device_memory, timeout=s.timeout)
                for check in checks if check != "plugins" for tp in (s.tp_sizes if check in TP_CHECKS else (1,))]

    def plugin_contexts(self, description: TargetDescription) -> dict[str, list[CheckContext]]:
        """The plugins check: one item per general-plugin entry point, ``enginecheck::plugin:<name>::plugins``."""
        s = self.settings
        return {f"plugin:{name}": [CheckContext(check="plugins", spec=s.target, architecture=f"plugin:{name}",
                                                module=value.split(":")[0], class_name=distribution,
                                                workdir=self.workdir, strict=s.strict, timeout=s.timeout,
                                                plugin=name)]
                for name, value, distribution in description.plugins}

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        """Add the check items before -k / -m selection runs."""
        description = self.describe_target()  # now: a bad target is a usage error, not a collection error
        checks = self.select_checks(description)
        contexts = {entry.architecture: self.contexts(entry, checks) for entry in description.entries}
        if "plugins" in checks:
            contexts = {**self.plugin_contexts(description), **contexts}
        collector = EngineCheckCollector.from_parent(session, name="enginecheck", nodeid="enginecheck",
                                                     contexts=contexts)
        items.extend(session.genitems(collector))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Keep each check's result (reports from xdist workers arrive here on the controller too)."""
        for name, value in report.user_properties:
            if name == RESULT_PROPERTY and report.when == "call" and isinstance(value, dict):
                self.results.append(value)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """The architecture x check table."""
        if self.results and not self.is_xdist_worker:
            terminalreporter.section("enginecheck summary")
            for line in summary_table(self.results):
                terminalreporter.write_line(line)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Write the JSON report and remove the session's generated checkpoints."""
        if self.settings.json_path and not self.is_xdist_worker:
            write_json(self.settings.json_path, self.settings.target, self.results)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
