"""The generated items: ``enginecheck::<architecture>::<check>`` (``load[tp=2]`` per TP size)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pytest

from pytest_enginecheck.checks import TP_CHECKS, CheckContext, CheckResult
from pytest_enginecheck.targets import ArchEntry

if TYPE_CHECKING:
    from pytest_enginecheck.session import EngineCheckSession

RESULT_PROPERTY = "enginecheck"


class CheckFailed(Exception):
    """Raised by a CheckItem whose check failed; reported as the check's own sentences."""

    def __init__(self, result: CheckResult) -> None:
        super().__init__(result.message)
        self.result = result


class EngineCheckCollector(pytest.Collector):
    """``enginecheck``: one ArchCollector per architecture of the target."""

    def __init__(self, *, manager: EngineCheckSession, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.manager = manager

    def collect(self) -> Iterator[pytest.Item | pytest.Collector]:
        for entry in self.manager.description.entries:
            yield ArchCollector.from_parent(self, name=entry.architecture, entry=entry)


class ArchCollector(pytest.Collector):
    """``enginecheck::<arch>``: one CheckItem per check (and TP size) that applies."""

    def __init__(self, *, entry: ArchEntry, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.entry = entry

    def collect(self) -> Iterator[pytest.Item]:
        manager: EngineCheckSession = self.parent.manager
        for check in manager.checks:
            ctx = manager.context(check, self.entry)
            if check in TP_CHECKS:
                for tp in manager.settings.tp_sizes:
                    yield CheckItem.from_parent(self, name=f"{check}[tp={tp}]", ctx=replace(ctx, tp=tp))
            else:
                yield CheckItem.from_parent(self, name=check, ctx=ctx)


class CheckItem(pytest.Item):
    """One check of one architecture, run in its own warm child process."""

    def __init__(self, *, ctx: CheckContext, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ctx = ctx
        self.add_marker("enginecheck")

    def runtest(self) -> None:
        from pytest_enginecheck.checks.runner import run_check

        result = run_check(self.ctx)
        self.user_properties.append((RESULT_PROPERTY, result.to_dict()))
        if result.outcome == "failed":
            raise CheckFailed(result)
        if result.outcome == "skipped":
            pytest.skip(result.message)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, CheckFailed):
            result = excinfo.value.result
            trace = result.detail.get("traceback")
            return f"{result.message}\n\n{trace}" if trace and result.detail.get("kind") != "cuda" else result.message
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"enginecheck {self.ctx.architecture} {self.name}"
