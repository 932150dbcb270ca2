"""Turns for the items that start more than one rank, shared by the pytest-xdist workers of one run.

An item that starts N > 1 ranks (``load[tp=2]``, ``startup`` at the largest TP size, ...) runs alone: while it
holds its turn no other check item of the run runs, and it waits until those running have finished; items of one
rank run side by side. So ``-n W`` runs at most ``max(W, N)`` ranks at once, and ``-n auto`` (one worker a core)
never runs more ranks than cores while every TP size fits the machine: no rank of a collective is starved of a
core by another item's ranks (gloo's timeouts then fire on a correct model).

A readers-writer lock of two ``flock`` files in the directory the run's workers share (the controller's basetemp):
every item first takes the turnstile alone, then the room (shared for one rank, alone for more) and lets the
turnstile go, so a multi-rank item waiting for the room holds the turnstile and no later item of one rank gets past
it (no starvation). flock locks die with their process: a killed worker never leaves a turn taken. pytest-xdist's
``--dist loadgroup`` would only send the multi-rank items to one worker, and does not group at all with pytest 9.2
(pytest-dev/pytest-xdist#1386); these turns hold whatever ``--dist`` mode runs the items.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

TURNSTILE = "enginecheck-turnstile.lock"
ROOM = "enginecheck-ranks.lock"


def turns_dir(config: pytest.Config) -> Path | None:
    """The directory the run's pytest-xdist workers share (the controller's basetemp, the parent of each
    worker's), or None outside a worker: one process runs one item at a time and needs no turns."""
    if not hasattr(config, "workerinput") or not config.option.basetemp:
        return None
    return Path(config.option.basetemp).parent


@contextlib.contextmanager
def _flock(path: Path, operation: int) -> Iterator[None]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, operation)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def rank_turn(directory: Path | None, ranks: int) -> Iterator[float]:
    """Hold an item's turn to start ``ranks`` ranks while the block runs (alone when ``ranks > 1``); yields the
    seconds it waited for it. No directory: no turns, no wait."""
    if directory is None:
        yield 0.0
        return
    started = time.monotonic()
    room = fcntl.LOCK_EX if ranks > 1 else fcntl.LOCK_SH
    with contextlib.ExitStack() as held:
        with _flock(directory / TURNSTILE, fcntl.LOCK_EX):
            held.enter_context(_flock(directory / ROOM, room))
        yield time.monotonic() - started
