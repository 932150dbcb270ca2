"""The one way engine_ref's parents wait: on answers and process sentinels, until a deadline.

run_isolated, the multiprocess executor (startup and every collective_rpc) and pytest_enginecheck's
``run_multirank`` all wait for an answer from each of several children while watching them die,
each call under its own ``Deadline``.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from multiprocessing.connection import Connection
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Deadline:
    """A moment on the monotonic clock by which a wait ends; ``Deadline(None)`` never comes."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds  # as asked for, for messages ("within 2 s")
        self.at = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        """Seconds left (0.0 once passed), or None without a deadline."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def shorten(self, seconds: float) -> None:
        """Move the deadline to ``seconds`` from now, unless it comes sooner already."""
        at = time.monotonic() + seconds
        self.at = at if self.at is None else min(self.at, at)


class AnswerWait(Generic[K]):
    """Wait for one message from each child in ``conns`` while watching the children's ``sentinels``.

    Iterating yields ``(key, message)`` as each message arrives and ``(key, None)`` when a child's
    process ended (or its pipe closed) without one. Messages come first: a child that answered and
    exited is not reported dead. Iteration stops when every child answered or at the deadline; then
    ``pending`` holds the keys that did not answer. ``watch_answered``: keep watching a child after
    its answer (a server that must not die) rather than letting it exit (a child that answers once).
    ``drains``: further connections to read as data comes, by a callback that returns False at EOF.
    """

    def __init__(self, conns: Mapping[K, Connection], sentinels: Mapping[K, int], deadline: Deadline, *,
                 watch_answered: bool = False, drains: Mapping[Connection, Callable[[], bool]] | None = None) -> None:
        self.pending = dict(conns)
        self.deadline = deadline
        self._sentinels = dict(sentinels)
        self._watch_answered = watch_answered
        self._drains = dict(drains or {})

    def __iter__(self) -> Iterator[tuple[K, bytes | None]]:
        while self.pending:
            watched = {s: k for k, s in self._sentinels.items() if self._watch_answered or k in self.pending}
            ready = multiprocessing.connection.wait([*self.pending.values(), *watched, *self._drains],
                                                    timeout=self.deadline.remaining())
            if not ready:
                return
            for conn in [c for c in self._drains if c in ready]:
                if not self._drains[conn]():
                    del self._drains[conn]
            for key, conn in list(self.pending.items()):
                if conn.poll():
                    del self.pending[key]
                    try:
                        message: bytes | None = conn.recv_bytes()
                    except (EOFError, ConnectionResetError):  # reset: it died with our message unread
                        message = None
                    if message is None:
                        self._sentinels.pop(key, None)
                    yield key, message
            for sentinel in ready:
                if not isinstance(sentinel, int) or sentinel not in watched:
                    continue
                key = watched[sentinel]
                if key in self._sentinels and (self._watch_answered or key in self.pending):
                    self.pending.pop(key, None)
                    del self._sentinels[key]
                    yield key, None


def read_burst(fd: int, wait_s: float, quiet_s: float = 0.2) -> str:
    """What arrives on ``fd`` after a request: ``wait_s`` at most for the first bytes, then until ``quiet_s`` quiet."""
    chunks: list[bytes] = []
    deadline = Deadline(wait_s)
    while not deadline.expired():
        if not multiprocessing.connection.wait([fd], timeout=quiet_s if chunks else 0.05):
            if chunks:
                break
            continue
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace")
