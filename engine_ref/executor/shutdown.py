"""How each worker ended at shutdown, and the threads that kept one from ending by itself.

A worker's process exits by itself once its teardown returned and its last non-daemon thread ended (Python
joins those at exit). So after its teardown a WorkerProc lists the non-daemon threads it still runs
(``live_threads``: name, target, stack) and sends them to the executor, which gives a worker that listed
some ``thread_grace_s`` to exit and then forces it (SIGTERM, then SIGKILL). The in-process worker (uni) has
no process to force: its executor joins the non-daemon threads started during the engine's life for
``thread_grace_s`` and lists those still alive. Either way each rank's ``WorkerExit`` says how it ended.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Literal

EndedBy = Literal["itself", "SIGTERM", "SIGKILL"]
EXITED_0 = "exited with code 0"
IN_PROCESS = "shut down in this process"  # the status of the uni executor's worker


@dataclass(frozen=True)
class LiveThread:
    """A non-daemon thread alive after a worker's teardown: it keeps the worker's process from exiting."""

    name: str
    target: str  # 'module.function' it runs ('module.Class.run' for a Thread subclass)
    stack: str  # its Python stack when it was listed, innermost frame last

    def describe(self) -> str:
        """``'kv-stats-poller-1' (target zoo.planted_thread.poll_kv_stats)``."""
        return f"{self.name!r} (target {self.target})"


def _target(thread: threading.Thread) -> str:
    target = getattr(thread, "_target", None)  # set while it runs (Thread.run deletes it at the end)
    if target is None:
        kind = type(thread)
        return f"{kind.__module__}.{kind.__qualname__}.run"
    return f"{getattr(target, '__module__', None) or '?'}.{getattr(target, '__qualname__', repr(target))}"


def non_daemon_threads(exclude: Collection[threading.Thread] = ()) -> list[threading.Thread]:
    """This process's live non-daemon threads, other than the main thread, the caller and ``exclude``."""
    skip = {threading.main_thread(), threading.current_thread(), *exclude}
    return [t for t in threading.enumerate() if not t.daemon and t.is_alive() and t not in skip]


def _format_stack(frame: FrameType) -> str:
    """The thread's stack without threading's own bootstrap frames above its target."""
    frames = [f for f in traceback.extract_stack(frame) if f.filename != threading.__file__]
    return "".join(traceback.format_list(frames))


def live_threads(threads: Sequence[threading.Thread]) -> tuple[LiveThread, ...]:
    """``threads`` that are still alive, with their names, targets and current stacks."""
    frames = sys._current_frames()
    found = []
    for thread in threads:
        frame = frames.get(thread.ident) if thread.ident is not None else None
        if thread.is_alive():
            stack = _format_stack(frame) if frame is not None else "(no Python frame)\n"
            found.append(LiveThread(thread.name, _target(thread), stack))
    return tuple(found)


def join_threads(threads: Sequence[threading.Thread], timeout_s: float) -> tuple[LiveThread, ...]:
    """Give ``threads`` ``timeout_s`` in all to end; return those still alive."""
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return live_threads(threads)


@dataclass(frozen=True)
class WorkerExit:
    """How one rank's worker ended at shutdown.

    ``ended_by``: "itself" (it exited when asked; in process: its teardown returned), or the signal the
    executor needed; ``status``: how its process ended ('exited with code 0', 'was killed by SIGTERM'), or
    IN_PROCESS; ``threads``: the non-daemon threads that kept it alive (multiprocess: listed after its
    teardown, kept only when it did not exit by itself; in process: those alive after ``thread_grace_s``);
    ``stacks``: its Python stacks (faulthandler) before SIGTERM, when it did not finish its teardown.
    """

    rank: int
    pid: int
    ended_by: EndedBy
    status: str
    threads: tuple[LiveThread, ...] = ()
    stacks: str = ""

    @property
    def clean(self) -> bool:
        """It ended by itself, successfully, and left no thread running."""
        return self.ended_by == "itself" and self.status in (EXITED_0, IN_PROCESS) and not self.threads

    def describe(self, who: str = "") -> str:
        """One clause: "rank 1 (pid 12) did not exit by itself and needed SIGTERM (it was killed by SIGTERM);
        still running after its teardown: non-daemon thread 'poller' (target m.poll)"; ``who`` replaces
        'rank 1 (pid 12)' (``describe_exits`` names several ranks at once)."""
        who = who or f"rank {self.rank} (pid {self.pid})"
        threads = ""
        if self.threads:
            threads = (f"non-daemon thread{'s' if len(self.threads) > 1 else ''} "
                       f"{', '.join(t.describe() for t in self.threads)}")
        if self.status == IN_PROCESS:
            return f"{who}, in this process, shut down but left {threads} running" if threads else f"{who} shut down"
        if self.ended_by == "itself":
            return f"{who} {self.status}"
        needed = f"did not exit by itself and needed {self.ended_by} (it {self.status})"
        if threads:
            return f"{who} {needed}; still running after its teardown: {threads}"
        return f"{who} {needed}: it did not finish its teardown"


_PLURAL = (("by itself", "by themselves"), ("(it ", "(each "), ("its teardown", "their teardown"),
           ("in this process, shut", "in this process, each shut"))


def describe_exits(exits: Sequence[WorkerExit]) -> tuple[str, str]:
    """``exits`` as clauses joined by '; ' (ranks that ended alike share one: "rank 0 (pid 1) and rank 1
    (pid 2) did not exit by itself ..."), and the stacks behind them (one block per distinct stack)."""
    ranks: dict[str, list[WorkerExit]] = {}
    for end in exits:
        ranks.setdefault(end.describe(who="{who}"), []).append(end)
    clauses = []
    for template, alike in ranks.items():
        if len(alike) > 1:
            for one, several in _PLURAL:
                template = template.replace(one, several)
        clauses.append(template.replace("{who}", " and ".join(f"rank {e.rank} (pid {e.pid})" for e in alike)))
    stacks: dict[tuple[str, str], list[int]] = {}
    for end in exits:
        for thread in end.threads:
            stacks.setdefault((f"thread {thread.describe()}", thread.stack), []).append(end.rank)
        if end.stacks.strip():
            stacks.setdefault((f"pid {end.pid}, all threads before {end.ended_by}", end.stacks), []).append(end.rank)
    blocks = [f"--- rank {', '.join(map(str, on))}: {what} ---\n{stack.rstrip()}"
              for (what, stack), on in stacks.items()]
    return "; ".join(clauses), "\n".join(blocks)
