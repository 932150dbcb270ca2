"""rank_turns: a multi-rank item runs alone among the run's workers, and no later one-rank item overtakes it
(real processes on the real locks; test_checks' xdist run asserts that every check item took its turn)."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_enginecheck.rank_turns import TURNSTILE, rank_turn, turns_dir

WAIT_S = 60.0  # the longest a step may take: only a broken lock reaches it


def _hold(directory: str, name: str, ranks: int, events: Any, release: Any) -> None:
    with rank_turn(Path(directory), ranks):
        events.put((name, "in", time.monotonic()))
        release.wait(WAIT_S)
        events.put((name, "out", time.monotonic()))


def _turnstile_taken(directory: Path) -> bool:
    fd = os.open(directory / TURNSTILE, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _drain(events: Any, seen: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    """``seen`` with the events that arrived since, by (name, "in"/"out")."""
    while not events.empty():
        name, what, when = events.get(timeout=WAIT_S)
        seen[name, what] = when
    return seen


def _until(predicate: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, "the step did not happen"
        time.sleep(0.01)


@pytest.fixture
def ctx() -> Any:
    return multiprocessing.get_context("fork")


def test_a_multi_rank_item_waits_for_the_running_one_and_no_later_one_overtakes_it(tmp_path: Path, ctx: Any) -> None:
    events = ctx.Queue()
    release = {name: ctx.Event() for name in "ABC"}
    procs = {}

    def start(name: str, ranks: int) -> None:
        procs[name] = ctx.Process(target=_hold, args=(str(tmp_path), name, ranks, events, release[name]))
        procs[name].start()

    seen: dict[tuple[str, str], float] = {}
    try:
        start("A", 1)  # a one-rank item running
        assert events.get(timeout=WAIT_S)[:2] == ("A", "in")
        start("B", 2)  # a TP=2 item: waits for A, holding the turnstile
        _until(lambda: _turnstile_taken(tmp_path))
        start("C", 1)  # a later one-rank item: must not overtake B
        time.sleep(0.5)
        assert events.empty(), "an item started beside the running one-rank item before the TP=2 item"
        release["A"].set()
        _until(lambda: ("B", "in") in _drain(events, seen))
        time.sleep(0.5)
        assert ("C", "in") not in _drain(events, seen), "a one-rank item started while the TP=2 item held its turn"
        release["B"].set()
        _until(lambda: ("C", "in") in _drain(events, seen))
        release["C"].set()
        _until(lambda: ("C", "out") in _drain(events, seen))
        # each turn began after the one before it ended (times of one clock: the queue may reorder the messages)
        assert seen["A", "out"] < seen["B", "in"] < seen["B", "out"] < seen["C", "in"], seen
    finally:
        for event in release.values():
            event.set()
        for proc in procs.values():
            proc.join(WAIT_S)
            if proc.is_alive():
                proc.kill()


def test_one_rank_items_run_side_by_side(tmp_path: Path, ctx: Any) -> None:
    events, release = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_hold, args=(str(tmp_path), name, 1, events, release)) for name in "AB"]
    try:
        for proc in procs:
            proc.start()
        assert sorted(events.get(timeout=WAIT_S)[:2] for _ in procs) == [("A", "in"), ("B", "in")]
    finally:
        release.set()
        for proc in procs:
            proc.join(WAIT_S)


def test_a_killed_holder_gives_its_turn_back(tmp_path: Path, ctx: Any) -> None:
    events, release = ctx.Queue(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), "A", 2, events, release))
    holder.start()
    assert events.get(timeout=WAIT_S)[:2] == ("A", "in")
    holder.kill()
    holder.join(WAIT_S)
    with rank_turn(tmp_path, 2) as waited:
        assert waited < WAIT_S


def test_no_turns_outside_an_xdist_worker(pytestconfig: pytest.Config) -> None:
    if hasattr(pytestconfig, "workerinput"):
        assert turns_dir(pytestconfig) == Path(pytestconfig.option.basetemp).parent
    else:
        assert turns_dir(pytestconfig) is None
    with rank_turn(None, 2) as waited:
        assert waited == 0.0

