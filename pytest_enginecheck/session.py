"""EngineCheckSession: the plugin object ``--enginecheck`` registers (pytest-memray style).

It describes the target (in a child process, once: pytest-xdist workers get the controller's
description), prints its settings in the header, generates the items at collection (and a collection
error per general plugin that raised while the target was described), gathers each
item's result from its report (so it works under pytest-xdist, where items run in workers), and
closes the run with the summary table and the JSON report.
"""

from __future__ import annotations

import fnmatch
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Generator
from typing import Any

import pytest

from pytest_enginecheck.checks import CHECKS, TP_CHECKS, CheckContext, CheckResult, roots
from pytest_enginecheck.html_report import write_html
from pytest_enginecheck.items import RESULT_PROPERTY, CheckItem, EngineCheckCollector, PluginErrorCollector
from pytest_enginecheck.report import fit, import_profile_lines, pack, summary_mode, summary_table, write_json
from pytest_enginecheck.settings import Settings
from pytest_enginecheck.targets import (
    ArchEntry,
    Offer,
    PluginError,
    Target,
    TargetDescription,
    TargetError,
    load_target,
)

DESCRIBE_TIMEOUT_S = 300.0
# What every check child imports: preloaded once in the warm parent instead of once per check.
CHILD_MODULES = ("pytest_enginecheck.checks.runner", "pytest_enginecheck.checks.import_check",
                 "pytest_enginecheck.targets.warm", "pytest_enginecheck.leaks", "pytest_enginecheck.import_profile")
TARGET_VARIABLE = "ENGINECHECK_TARGET"  # the spec, for the warm parent (``targets.warm``)
DESCRIPTION_KEY = "enginecheck_description"  # in an xdist worker's workerinput: the controller's, pickled
PYTEST_OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")


class EngineCheckSession:
    """Generates the check items of one pytest run and reports their results."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        from engine_ref.isolation import add_preload_modules

        self.config = config
        self.settings = settings
        self._workdir: str | None = None
        try:
            self.target: Target = load_target(settings.target)
            self.target.check_settings(settings)
        except TargetError as e:
            raise pytest.UsageError(str(e)) from None
        self.target.prepare_children(self.workdir)  # before the warm parent starts: every check child inherits it
        os.environ[TARGET_VARIABLE] = settings.target  # the warm parent loads it once for every child
        add_preload_modules(*CHILD_MODULES,
                            *self.target.warm_parent_modules(self.early_checks(), settings.strict))
        if settings.trace_dir:  # the check children inherit it: each engine start writes its trace there
            os.makedirs(settings.trace_dir, exist_ok=True)
            os.environ["ENGINE_REF_TRACE_DIR"] = settings.trace_dir
        self.results: list[dict[str, Any]] = []
        self._description: TargetDescription | None = None
        self.outcomes: dict[str, dict[str, CheckResult]] = {}  # arch -> item name -> result, known in this process
        self.nothing_selected = ""  # why no check may have been selected (see nothing_selected_note)

    @property
    def is_xdist_worker(self) -> bool:
        return hasattr(self.config, "workerinput")

    @property
    def description(self) -> TargetDescription:
        """The target's description: the controller's in an xdist worker, else described here once."""
        if self._description is None:
            given = getattr(self.config, "workerinput", {}).get(DESCRIPTION_KEY)
            self._description = pickle.loads(given) if given is not None else self.describe_target()
        return self._description

    def early_checks(self) -> tuple[str, ...]:
        """The checks selected, known before the target is described (from ``Target.offered``, without importing
        the engine, so a check the target cannot run is a usage error at once)."""
        return self._select(self.target.offered(), self.target.name)

    def describe_target(self) -> TargetDescription:
        """The target's architectures, resolved in a child process (the pytest process stays light)."""
        from engine_ref.isolation import run_isolated
        from pytest_enginecheck.targets import describe

        try:
            return run_isolated(describe, self.settings.target, self.settings.strict, timeout=DESCRIBE_TIMEOUT_S,
                                name="enginecheck describe target")
        except TargetError as e:
            raise pytest.UsageError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - the target's own failure, told plainly
            raise pytest.UsageError(
                f"--enginecheck-target={self.settings.target!r} could not be loaded: {type(e).__name__}: {e}"
            ) from None

    def select_checks(self, description: TargetDescription) -> tuple[str, ...]:
        """The checks to run, in CHECKS order: those asked for, or all that the target offers."""
        return self._select(description.offer, description.kind)

    def _select(self, offer: Offer, kind: str) -> tuple[str, ...]:
        if self.settings.checks is None:
            return tuple(c for c in CHECKS if c in offer.checks)
        refused = [c for c in self.settings.checks if c not in offer.checks]
        if refused:
            by_reason: dict[str, list[str]] = {}  # one sentence per reason: vLLM refuses five checks for one cause
            for check in refused:
                by_reason.setdefault(offer.why_not(check) or "", []).append(check)
            reasons = "; ".join(f"{', '.join(checks)}: {why}" if why else ", ".join(checks)
                                for why, checks in by_reason.items())
            raise pytest.UsageError(f"--enginecheck-checks: {', '.join(refused)} cannot run on a {kind} target "
                                    f"(only {', '.join(offer.checks)}): {reasons}.")
        return tuple(c for c in CHECKS if c in self.settings.checks)

    @property
    def workdir(self) -> str:
        if self._workdir is None:
            from engine_ref.isolation.tempdirs import owner_dir

            # In this process's own temp dir: a killed pytest run's checkpoints are swept at the next start.
            self._workdir = tempfile.mkdtemp(prefix="enginecheck-", dir=owner_dir())
        return self._workdir

    def contexts(self, entry: ArchEntry, checks: tuple[str, ...]) -> list[CheckContext]:
        """One context per item of ``entry``: per check, and per TP size for TP_CHECKS; a quantization method the
        target refuses here (vLLM's fp8) makes no item (the header names it once). An architecture that
        --enginecheck-fail-on-skip selects also gets the items of the checks the run asks for and the target refuses
        (``refused_checks``): each fails with the refusal instead of being dropped."""
        s, offer = self.settings, self.description.offer
        required = self.required(entry.architecture)
        refused = self.refused_checks(offer) if required else ()
        methods = tuple(m for m in s.quant_methods if offer.why_not(f"quant[{m}]") is None)
        return [CheckContext(check=check, spec=s.target, architecture=entry.architecture, module=entry.module,
                             class_name=entry.class_name, workdir=self.workdir, tp=tp, quantization=method, options=s,
                             required=required, refused=(offer.why_not(check) or "") if check in refused else "")
                for check in CHECKS if check in (*checks, *refused) and check != "plugins"
                for method in (methods if check == "quant" else (None,))
                for tp in (s.tp_sizes if check in TP_CHECKS else (1,))]

    def refused_checks(self, offer: Offer) -> tuple[str, ...]:
        """The checks of an architecture this run asks for and the target does not offer here: every one it refuses
        when --enginecheck-checks does not narrow the run (naming a refused one there is a usage error at once), in
        CHECKS order; not the plugins check (an item per plugin, not per architecture), nor an item such as
        ``quant[fp8]``."""
        if self.settings.checks is not None:
            return ()
        refused = {check for check, _ in offer.refused}
        return tuple(c for c in CHECKS if c in refused and c != "plugins")

    def required(self, architecture: str) -> bool:
        """Whether --enginecheck-fail-on-skip selects ``architecture``: its items' skips fail."""
        chosen = self.settings.fail_on_skip
        return ("all" in chosen or ("plugins" in chosen and architecture in self.description.from_plugins)
                or any(fnmatch.fnmatchcase(architecture, pattern) for pattern in chosen))

    def plugin_contexts(self, description: TargetDescription) -> dict[str, list[CheckContext]]:
        """The plugins check: one item per general-plugin entry point, ``enginecheck::plugin:<name>::plugins``."""
        s = self.settings
        return {f"plugin:{name}": [CheckContext(check="plugins", spec=s.target, architecture=f"plugin:{name}",
                                                module=value.split(":")[0], class_name=distribution,
                                                workdir=self.workdir, plugin=name, options=s)]
                for name, value, distribution in description.plugins}

    def settings_lines(self, width: int | None = None, verbose: bool = False) -> list[str]:
        """What this run checks, in a line or two of ``width`` columns (as pytest-timeout prints its settings): the
        target, the checks, the TP sizes and the budget, and any other setting given a value of its own (``verbose``:
        every setting); then what the target does not offer here, and why (an item such as quant[fp8] only where this
        run asks for it, unless ``verbose``)."""
        s, description, default = self.settings, self.description, Settings()
        checks = self.select_checks(description)
        plugins = self.target.plugin_count()
        what = [f"target={s.target} ({len(description.entries)} architectures, {plugins} "
                f"plugin{'s' if plugins != 1 else ''})"]
        if verbose or {*TP_CHECKS, "startup"} & set(checks):
            what.append(f"tp={','.join(map(str, s.tp_sizes))}")
        parts = [f"checks={','.join(checks)}"]
        if verbose or "quant" in checks:
            parts.append(f"quant={','.join(s.quant_methods)}")
        budget = (s.budget_utilization, s.budget_max_model_len) != (default.budget_utilization,
                                                                     default.budget_max_model_len)
        if verbose or budget:
            parts.append(f"budget={s.budget_memory} per rank x {s.budget_utilization:g} utilization at "
                         f"max_model_len={s.budget_max_model_len}")
        elif "budget" in checks:
            parts.append(f"budget={s.budget_memory} per rank")
        if verbose or s.timeout != default.timeout:
            parts.append(f"timeout={s.timeout:g}s")
        if verbose or s.device_memory:
            parts.append(f"device_memory={s.device_memory or 'not predicted'}")
        if verbose or s.strict:
            parts.append(f"strict={'on' if s.strict else 'off'}")
        given = dict(s.target_options)
        parts += [f"{option.name}={given[option.name]}" for option in self.target.options
                  if option.name in given and (verbose or given[option.name] != option.default)]
        lines = pack("enginecheck: ", what, width) + pack("enginecheck: ", parts, width)
        refused = tuple((item, why) for item, why in description.offer.refused
                        if verbose or self.concerns_this_run(item, checks))
        if refused:
            lines += fit(f"enginecheck: not offered: {Offer(description.offer.checks, refused).sentence()}", width)
        for note in description.offer.notes:
            lines += fit(f"enginecheck: note: {note}", width)
        return lines

    def dropped_line(self) -> str:
        """The line closing a run that asked for every check and got fewer ('' when it got them all): what was not
        checked and why, and whether --enginecheck-fail-on-skip fails it; even under -q, where pytest prints no
        header."""
        if self._description is None:
            return ""
        offer = self._description.offer
        dropped = self.refused_checks(offer)
        if not dropped:
            return ""
        why = Offer(offer.checks, tuple((c, offer.why_not(c) or "") for c in dropped)).sentence()
        then = ("they fail for the architectures --enginecheck-fail-on-skip selects" if self.settings.fail_on_skip else
                "--enginecheck-fail-on-skip=all (or plugins, or patterns of architectures) makes them fail")
        return f"enginecheck: not checked (not offered by the {self._description.kind} target here): {why}; {then}"

    def concerns_this_run(self, refused: str, checks: tuple[str, ...]) -> bool:
        """Whether the header names a refused ``check`` or ``check[param]`` without -v: a check always (it says why the
        check is missing), an item only where this run asks for it (``quant[fp8]``: quant selected, fp8 among
        --enginecheck-quant)."""
        check, _, param = refused.partition("[")
        return not param or (check == "quant" and check in checks and param.rstrip("]") in self.settings.quant_methods)

    def plugin_error_text(self, error: PluginError) -> str:
        """The collection error of a plugin that raised while the target was described: what, where, what it
        took with it, how to run without it, and its traceback."""
        hint = ""
        if self.target.plugin_group is not None:
            others = ",".join(name for name, _, _ in self.description.plugins)
            hint = (f"\nFix or uninstall it, or leave it out with {self.target.plugin_group.variable}={others!r} "
                    f"(the names to load; empty loads none).")
        return (f"{error.message}\nIt failed while the target was described; {error.lost_words()}.{hint}\n\n"
                f"{error.traceback}")

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        """The settings lines (``-v``: every setting), and a line per plugin that raised while the target was
        described (with the architectures it took with it); describing the target here makes a bad target a usage
        error before collection."""
        if self.is_xdist_worker:
            return []
        width = config.get_terminal_writer().fullwidth
        lines = self.settings_lines(width, verbose=config.getoption("verbose") > 0)
        for e in self.description.plugin_errors:
            lines += fit(f"enginecheck: plugin {e.name!r} of distribution {e.distribution} raised while the target was "
                         f"described (ERROR collecting enginecheck::plugin:{e.name}): {e.lost_words()}", width)
        return lines

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """pytest-xdist: each worker gets this process's description instead of describing the target again."""
        node.workerinput[DESCRIPTION_KEY] = pickle.dumps(self.description)

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        """Add the check items before -k / -m selection runs."""
        description = self.description  # now at the latest: a bad target is a usage error, not a collection error
        checks = self.select_checks(description)
        contexts = {entry.architecture: self.contexts(entry, checks) for entry in description.entries}
        if "plugins" in checks:
            contexts = {**self.plugin_contexts(description), **contexts}
        for error in description.plugin_errors:  # collection errors, as for a test module that fails to import
            failed = PluginErrorCollector.from_parent(session, name=f"plugin:{error.name}",
                                                      nodeid=f"enginecheck::plugin:{error.name}",
                                                      text=self.plugin_error_text(error))
            items.extend(session.genitems(failed))
        collector = EngineCheckCollector.from_parent(session, name="enginecheck", nodeid="enginecheck",
                                                     contexts=contexts)
        items.extend(session.genitems(collector))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Give each selected check the selected roots of its failures (after -k / -m: a deselected root
        blames nothing)."""
        selected = {(item.ctx.architecture, item.name): item for item in session.items if isinstance(item, CheckItem)}
        if not selected and not self.is_xdist_worker:
            self.nothing_selected = self.nothing_selected_note()
        for (arch, _), item in selected.items():
            found = {name: (selected[arch, name].nodeid, selected[arch, name].ctx)
                     for name in roots(item.ctx) if (arch, name) in selected}
            item.depend_on(found, self.outcomes.setdefault(arch, {}))

    def nothing_selected_note(self) -> str:
        """Why a run may have selected no check: other engines' general plugins are installed, and their
        architectures are checked with their own target ('' when there are none)."""
        from pytest_enginecheck.targets import other_targets_plugins

        others = other_targets_plugins(self.settings.target)
        return "; ".join(
            f"the {name} target's general plugins {', '.join(plugins)} are installed: their architectures are checked "
            f"with --enginecheck-target={name}" for name, plugins in others)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]
                                  ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """A skipped check reads as its architecture and reason (``SKIPPED [6] enginecheck::Arch: import failed,
        see ...``), so the skips of one root cause fold into one line."""
        report: pytest.TestReport = yield
        if isinstance(item, CheckItem) and item.parent and report.skipped and isinstance(report.longrepr, tuple):
            # pytest folds skips by (path, line, reason); no line number, so one root cause folds into one line
            report.longrepr = (str(item.session.startpath / item.parent.nodeid), None,  # type: ignore[assignment]
                               report.longrepr[2])
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Keep each check's result (reports from xdist workers arrive here on the controller too)."""
        for name, value in report.user_properties:
            if name == RESULT_PROPERTY and report.when == "call" and isinstance(value, str):
                self.results.append(json.loads(value))

    def other_tests(self, stats: dict[str, list[Any]]) -> dict[str, int]:
        """pytest's counts of the tests that ran beside the checks, by outcome. A module skipped at collection (a
        module-level ``pytest.importorskip``) counts only where its tests could have run beside them: not in a run
        that deselected tests (``-m enginecheck``) and ran none but the checks."""
        reports = {outcome: [r for r in stats.get(outcome, ()) if getattr(r, "count_towards_summary", True)
                             and not r.nodeid.startswith("enginecheck::")] for outcome in PYTEST_OUTCOMES}
        ran = any(isinstance(r, pytest.TestReport) for found in reports.values() for r in found)
        option = self.config.option
        narrowed = any((stats.get("deselected"), getattr(option, "markexpr", ""), getattr(option, "keyword", ""),
                        getattr(option, "deselect", None)))
        if narrowed and not ran:
            reports["skipped"] = [r for r in reports["skipped"] if not isinstance(r, pytest.CollectReport)]
        return {outcome: len(found) for outcome, found in reports.items()}

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """The architecture x check table (fit to the terminal's width), and the counts of the run's other tests
        beside its own."""
        if self.nothing_selected:
            terminalreporter.write_line(f"enginecheck: no check of --enginecheck-target={self.settings.target} was "
                                        f"selected; {self.nothing_selected}.", yellow=True)
        archs = len({r["arch"] for r in self.results})
        mode = summary_mode(self.settings.summary, archs)
        dropped = "" if self.is_xdist_worker else self.dropped_line()
        if not self.results or self.is_xdist_worker or mode == "none":
            if dropped:
                terminalreporter.write_line(dropped, yellow=True)
            return
        terminalreporter.section("enginecheck summary")
        width = self.config.get_terminal_writer().fullwidth
        for line in summary_table(self.results, mode, self.other_tests(terminalreporter.stats), width):
            terminalreporter.write_line(line)
        if dropped:
            terminalreporter.write_line(dropped, yellow=True)
        if self.settings.import_profile:
            terminalreporter.section("enginecheck import profile")
            for line in import_profile_lines(self.results, self.settings.import_profile):
                terminalreporter.write_line(line)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Write the JSON report and remove the session's generated checkpoints."""
        try:
            if self.settings.json_path and not self.is_xdist_worker:
                write_json(self.settings.json_path, self.settings.target, self.results)
            if self.settings.html_path and not self.is_xdist_worker:
                write_html(self.settings.html_path, self.settings.target, self.results)
        finally:
            if self._workdir is not None:
                shutil.rmtree(self._workdir, ignore_errors=True)
