"""Shared fixtures: tiny checkpoints generated once per session, with a fixed seed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import LLAMA

# Test modules that hold a worker longest (their engines, Ray clusters and pytest runs): run first, so that the
# pytest-xdist workers end together instead of one finishing a long test alone.
LONG_MODULES = ("test_ray.py", "test_leftovers.py", "test_cli.py", "test_general_plugins.py", "test_fixtures.py",
                "test_checks.py", "test_estimate.py", "test_multiproc.py", "test_quantization.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the tests by cost, keeping the collection's order within each rank: the tests of LONG_MODULES first,
    and last the tests that read a shared zoo session (a fixture their module's ``ZOO_SESSIONS`` names,
    tests/zoo_sessions.py), so the session has the whole run to finish in the background instead of holding a
    worker that waits for it. (A module fixture those readers share with the module's other tests would be set up
    twice: the session-reading fixtures are the only module fixtures of those modules.) Every worker collects the
    same order, as pytest-xdist requires."""
    def rank(item: pytest.Item) -> int:
        readers = getattr(getattr(item, "module", None), "ZOO_SESSIONS", {})
        if any(fixture in readers for fixture in getattr(item, "fixturenames", ())):
            return 2
        return 0 if item.path.name in LONG_MODULES else 1

    items.sort(key=rank)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the shared zoo sessions the selected tests read (tests/zoo_sessions.py) in the background now, so
    they run beside the other tests."""
    if session.config.option.collectonly or not session.items:
        return
    from tests.zoo_sessions import start_needed

    start_needed(session.config._tmp_path_factory,  # type: ignore[attr-defined]
                 [item for item in session.items if isinstance(item, pytest.Function)])


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Where the whole run ends (the xdist controller, or the one process without xdist): a background zoo session
    still running is stopped, never left behind."""
    if not hasattr(session.config, "workerinput"):
        from tests.zoo_sessions import stop_unfinished

        stop_unfinished(session.config._tmp_path_factory)  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_checkpoint(arch, **make_checkpoint_kwargs) -> Path``, cached per arguments for the session.

    Tests must not modify the returned directory; copy it first (``shutil.copytree``) to corrupt it.
    """
    from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint

    made: dict[str, Path] = {}

    def make(architecture: str, **kwargs: Any) -> Path:
        key = f"{architecture}-{sorted(kwargs.items())}"
        if key not in made:
            made[key] = make_checkpoint(architecture, tmp_path_factory.mktemp(architecture), **kwargs)
        return made[key]

    return make


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts (each in its own process group): killed with their groups at teardown."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A private temp dir with a short path, for a TMPDIR: multiprocessing's forkserver binds a Unix
    socket under TMPDIR (at most 107 bytes), and pytest's tmp_path under xdist is too deep for it."""
    path = Path(tempfile.mkdtemp(prefix="ec-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def llama(tiny_checkpoint: Callable[..., Path]) -> Path:
    """The tiny Llama checkpoint shared by the whole session (read-only)."""
    return tiny_checkpoint(LLAMA)
