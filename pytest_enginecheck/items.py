"""The generated items: ``enginecheck::<architecture>::<check>`` (``load[tp=2]`` per TP size)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import pytest

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckResult, item_name
from pytest_enginecheck.output import Authorship, full_output, trimmed_output, trimmed_traceback
from pytest_enginecheck.rank_turns import rank_turn, turns_dir
from pytest_enginecheck.targets import TargetError, load_target

if TYPE_CHECKING:
    from _pytest._code.code import TerminalRepr

RESULT_PROPERTY = "enginecheck"  # the user property (and JUnit XML property) holding the result, as JSON


class EngineCheckCollector(pytest.Collector):
    """``enginecheck``: one ArchCollector per architecture, given the contexts of its items."""

    def __init__(self, *, contexts: Mapping[str, Sequence[CheckContext]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.contexts = contexts

    def collect(self) -> Iterator[pytest.Item | pytest.Collector]:
        for architecture, contexts in self.contexts.items():
            yield ArchCollector.from_parent(self, name=architecture, contexts=contexts)


class ArchCollector(pytest.Collector):
    """``enginecheck::<arch>``: one CheckItem per check (and TP size) that applies."""

    def __init__(self, *, contexts: Sequence[CheckContext], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.contexts = contexts

    def collect(self) -> Iterator[pytest.Item]:
        for ctx in self.contexts:
            yield CheckItem.from_parent(self, name=item_name(ctx), ctx=ctx)


class CheckItem(pytest.Item):
    """One check of one architecture, run in its own warm child process."""

    def __init__(self, *, ctx: CheckContext, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ctx = ctx
        self.result: CheckResult | None = None
        self.roots: Mapping[str, tuple[str, CheckContext]] = {}
        self.known: MutableMapping[str, CheckResult] = {}
        self.add_marker("enginecheck")
        # the ranks it starts at once: startup runs at the largest TP size
        self.ranks = max(1, max(ctx.options.tp_sizes) if ctx.check == "startup" else ctx.tp)
        if self.ranks > 1 and self.config.pluginmanager.hasplugin("xdist"):
            # pytest-xdist's --dist loadgroup sends the items of one group to one worker (the group names no rank
            # count, so node ids, and pytest-split's durations, do not depend on --enginecheck-tp); rank_turns makes
            # them run alone whatever the --dist mode.
            self.add_marker(pytest.mark.xdist_group("enginecheck-multirank"))

    def depend_on(self, roots: Mapping[str, tuple[str, CheckContext]], known: MutableMapping[str, CheckResult]
                  ) -> None:
        """Set the selected items whose failure this item's failure may repeat, and the results of its
        architecture's items known in this process, shared by them (see ``runner.run_item``)."""
        self.roots = roots
        self.known = known

    def runtest(self) -> None:
        from pytest_enginecheck.checks.runner import run_item

        if self.ctx.refused:  # a check the target does not offer here, of a required architecture: nothing to run
            self.result = CheckResult(self.ctx.architecture, self.name, "skipped", 0.0,
                                      f"not offered here: {self.ctx.refused}", {"kind": "not_offered"})
        else:
            with rank_turn(turns_dir(self.config), self.ranks) as waited:
                result = run_item(self.ctx, self.roots, self.known)
            # the wait for its turn is the run's, not the check's: a phase beside its own, not in its duration
            self.result = dataclasses.replace(result, phases={**result.phases, "turn.wait": round(waited, 4)}
                                              ) if waited else result
        if self.ctx.required and self.result.outcome == "skipped" and self.result.detail.get("kind") != "dependency":
            self.result = required_skip(self.result)
        self.user_properties.append((RESULT_PROPERTY, json.dumps(self.result.to_dict())))
        if self.result.outcome == "failed":
            raise CheckFailure(self.result.message, self.result.detail)
        if self.result.outcome == "skipped":
            pytest.skip(self.result.message)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str | TerminalRepr:
        if isinstance(excinfo.value, CheckFailure) and self.result is not None:
            return self.result.longrepr(lambda trace: trimmed_traceback(trace, self.authorship()))
        return super().repr_failure(excinfo)

    def add_report_section(self, when: str, key: str, content: str) -> None:
        """What the check's process printed (its child writes it to this process's stderr, which pytest captures),
        trimmed to what concerns the failure (``output.trimmed_output``); nothing of a check that passed."""
        if self.result is not None and self.result.outcome == "passed" and not full_output():
            return
        super().add_report_section(when, key, trimmed_output(content, self.authorship()))

    def authorship(self) -> Authorship:
        """Which frames of a traceback are the author's: the architecture's module, not its engine's packages."""
        try:
            library = load_target(self.ctx.spec).library_packages()
        except TargetError:
            library = ()
        return Authorship(self.ctx.module, library)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"enginecheck {self.ctx.architecture} {self.name}"


def required_skip(result: CheckResult) -> CheckResult:
    """A skip of an architecture --enginecheck-fail-on-skip selects, as the failure it is for this run."""
    fix = ("run it where the target offers it (the reason says how), or name the checks to run with "
           "--enginecheck-checks" if result.detail.get("kind") == "not_offered" else "make the check apply to it")
    return dataclasses.replace(result, outcome="failed", message=(
        f"{result.arch} {result.check} was not checked ({result.message}), and --enginecheck-fail-on-skip selects "
        f"{result.arch}: {fix}, or leave it out of --enginecheck-fail-on-skip."),
        detail={**result.detail, "kind": "required_skip", "skip_reason": result.message})


class PluginErrorCollector(pytest.Collector):
    """``enginecheck::plugin:<name>`` for a general plugin that raised while the target was described: its
    collection fails with ``text``, as a test module that fails to import does (whatever checks are selected)."""

    def __init__(self, *, text: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.text = text

    def collect(self) -> Iterator[pytest.Item]:
        raise self.CollectError(self.text)
