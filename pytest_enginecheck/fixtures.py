"""Fixtures for model authors' own startup tests: no_cuda, isolated, multirank, engine.

Nothing heavy is imported until a fixture is used.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

DEFAULT_TIMEOUT_S = 120.0
CALL_REPORT = pytest.StashKey[pytest.TestReport]()


@pytest.fixture
def no_cuda(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The CUDA guard, on for the test body: touching CUDA raises CudaAccessError and fails the test,
    even when the code under test swallows the exception."""
    from pytest_enginecheck.guard import CudaGuard

    with CudaGuard() as guard:
        yield guard
    report = request.node.stash.get(CALL_REPORT, None)
    if guard.accesses and report is not None and report.passed:
        access = guard.accesses[0]
        pytest.fail(f"The test passed, but its code {access.describe()}\n{access.fix_hint}", pytrace=False)


@pytest.fixture
def isolated() -> Callable[..., Any]:
    """``isolated(fn, *args, timeout=120, **kwargs)``: run ``fn`` in a fresh warm child process and
    return its value, or re-raise its exception (with the child's traceback as the cause). A crash
    or a timeout raises ProcessCrashedError / ProcessTimeoutError (stacks included)."""
    from engine_ref.isolation import run_isolated

    def run(fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> Any:
        return run_isolated(fn, *args, timeout=timeout, **kwargs)

    return run


def _marker_arg(request: pytest.FixtureRequest, name: str, key: str | None = None) -> Any:
    marker = request.node.get_closest_marker(name)
    if marker is None:
        return None
    if marker.args:
        return marker.args[0]
    if key and key in marker.kwargs:
        return marker.kwargs[key]
    raise pytest.UsageError(f"@pytest.mark.{name} needs a value, e.g. @pytest.mark.{name}"
                            f"({key + '=' if key else ''}...)")


@pytest.fixture
def multirank(request: pytest.FixtureRequest) -> Callable[..., list[Any]]:
    """``multirank(fn, world_size=2, timeout=120)``: run ``fn(rank, world_size)`` on real ranks in a gloo
    process group (and engine_ref's TP group); return the per-rank results. A failing rank fails the
    test with that rank's traceback; a hang is dumped and killed. ``@pytest.mark.world_size(n)`` sets
    the default world size."""
    from pytest_enginecheck.multirank import run_multirank

    default_world_size = _marker_arg(request, "world_size", "n")
    if default_world_size is None:
        default_world_size = 2
    elif isinstance(default_world_size, bool) or not isinstance(default_world_size, int) or default_world_size < 1:
        pytest.fail(f"@pytest.mark.world_size({default_world_size!r}) on {request.node.name}: give a positive number "
                    f"of ranks, e.g. @pytest.mark.world_size(2)", pytrace=False)

    def run(fn: Callable[..., Any], *args: Any, world_size: int | None = None,
            timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        size = default_world_size if world_size is None else world_size
        return run_multirank(fn, size, *args, timeout=timeout, **kwargs)

    return run


@pytest.fixture
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Any]]:
    """``engine(model_dir_or_architecture, **LLM_kwargs) -> LLM``: start an engine_ref engine (an
    architecture name gets a tiny checkpoint), shut it down at teardown, and fail the test if it left
    a process, pipe, socket, temp entry or shared-memory segment behind.

    The engines get a private temp dir (TMPDIR) for the test. Under
    ``@pytest.mark.memory_budget(per_rank="512MiB")`` the engine's device memory defaults to the
    budget, and the test fails when a rank needs more (weights + activations + KV of one request)
    at startup; the requests the test then serves are measured too (each rank's peak in prefill
    and in decode steps), and teardown fails when one of them needed more than the budget.
    """
    from engine_ref.errors import KVCacheTooSmallError
    from engine_ref.isolation import ensure_warm_parent
    from engine_ref.utils import parse_size
    from pytest_enginecheck.budget import budget_violations, describe_shortfall
    from pytest_enginecheck.leaks import ResourceSnapshot, wait_for_no_leaks

    budget_text = _marker_arg(request, "memory_budget", "per_rank")
    budget = parse_size(budget_text, "memory_budget(per_rank)") if budget_text is not None else None
    ensure_warm_parent()
    # A private temp dir for the test: what its engines leave there is theirs, not another
    # process's (pytest-xdist workers and other jobs share the system's).
    private_tmp = tmp_path_factory.mktemp("engine-tmp")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    before = ResourceSnapshot.take(watch=True)
    started: list[Any] = []

    def start(model: str | os.PathLike[str], **kwargs: Any) -> Any:
        from engine_ref.entrypoints.llm import LLM
        from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint
        from engine_ref.plugins import load_general_plugins

        load_general_plugins()  # a plugin's architecture is a valid name here, as in LLM(...)
        path = Path(model)
        if not path.exists():
            path = make_checkpoint(str(model), tmp_path_factory.mktemp(str(model)))
        if budget is not None:
            kwargs.setdefault("device_memory", budget)
        try:
            llm = LLM(str(path), **kwargs)
        except KVCacheTooSmallError as e:
            if budget is None or e.shortfall is None:
                raise
            violations = [describe_shortfall(e.shortfall, budget)]
        else:
            started.append(llm)
            violations = budget_violations(llm.startup_report, budget) if budget is not None else []
        if violations:
            pytest.fail(f"memory_budget(per_rank={budget_text!r}): " + "; ".join(violations), pytrace=False)
        if budget is not None:
            llm.engine.executor.collective_rpc("track_step_memory")  # the test's requests: _serving_violations
        return llm

    serving: list[str] = []
    try:
        yield start
    finally:
        try:
            if budget is not None:
                serving = [v for llm in started for v in _serving_violations(llm, budget)]
        finally:
            for llm in started:
                llm.shutdown()
            leaks = wait_for_no_leaks(before, ignore_regular_files=True)
            monkeypatch.undo()
    failures = [f"the engine(s) this test started left behind: {'; '.join(leaks)}"] if leaks else []
    if serving:
        failures.insert(0, f"memory_budget(per_rank={budget_text!r}): the engine fits at startup but not while "
                           f"serving this test's requests: {'; '.join(serving)}")
    if failures:
        pytest.fail(". ".join(failures), pytrace=False)


def _serving_violations(llm: Any, budget_bytes: int) -> list[str]:
    """The ranks of ``llm`` whose prefill or decode steps, in the requests the test served, needed more than
    ``budget_bytes``; none where it served nothing or is gone (the test stopped it, or it failed there)."""
    from engine_ref.errors import EngineRefError
    from pytest_enginecheck.budget import workload_violations

    try:
        workers = llm.engine.executor.worker_reports()
    except EngineRefError:
        return []
    if not any(w.workload is not None and w.workload.steps for w in workers):
        return []
    return workload_violations(llm.startup_report, workers, budget_bytes)
