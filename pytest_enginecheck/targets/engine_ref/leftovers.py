"""What every engine an engine_ref check starts leaves behind (load, budget, lora, quant, startup: all start theirs
through ``tiny_engine.start_engine``), and the check's verdict on it.

``EngineWatch`` spans one engine's whole life: its start, the check's requests, its shutdown. Before the start it
takes this process's resource snapshot (leaks.ResourceSnapshot: child processes, open descriptors, listening
sockets, the private temp dir's entries, /dev/shm) and starts an EntryWatch on /tmp and the working directory
(entry_watch: the entries this process's tree makes there, told apart from a neighbour's by the pid of their maker).
After the shutdown it records how each worker ended (engine_ref.executor.shutdown: one that needed SIGTERM or
SIGKILL, and the non-daemon threads that kept it alive, with their stacks) and what is left.

The verdict comes after the check's own (``reported_after``, around the check's function): a check that fails keeps
its own failure, with what its engines left behind added, so a sharding bug is still named as one; a check that
passes fails on the first engine that left something, naming it: the process and its command line, the thread and
its stack, the file.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.entry_watch import EntryWatch, MadeEntries
from pytest_enginecheck.leaks import ResourceSnapshot, wait_for_no_leaks, watch_only_this_engine

if TYPE_CHECKING:
    from types import TracebackType

    from engine_ref.executor.shutdown import WorkerExit
    from pytest_enginecheck.targets import CheckFunction

ADVICE = ("A worker must exit by itself once the engine shuts down: stop and join the threads the model starts "
          "(or make them daemon threads), and do not block its teardown.")
ENTRIES_ADVICE = ("Write an engine's files under tempfile.gettempdir() (each engine gets its own) and remove them by "
                  "the time it shuts down, never at a fixed path in /tmp or in the working directory.")


@dataclass
class EngineEnd:
    """How one engine of a check ended: at ``tensor_parallel_size``, its workers that did not exit cleanly by
    themselves, what it left (``leaks``, as leaks.py and the entry watch describe them), what the entry watch saw."""

    tensor_parallel_size: int
    unclean: list[WorkerExit]
    leaks: list[str]
    thread_grace_s: float
    entries: MadeEntries = field(default_factory=MadeEntries)

    @property
    def clean(self) -> bool:
        """Every worker ended by itself and nothing was left."""
        return not self.unclean and not self.leaks

    def failure(self, architecture: str) -> CheckFailure:
        """The finding, in startup's words: an unclean shutdown (with what was left too), else what was left."""
        from engine_ref.executor.shutdown import describe_exits

        tp = self.tensor_parallel_size
        entries = self.entries.summary()
        if self.unclean:
            left = f" It also left behind: {'; '.join(self.leaks)}." if self.leaks else ""
            how, stacks = describe_exits(self.unclean)
            return CheckFailure(
                f"{architecture} started at tensor_parallel_size={tp}, but did not shut down cleanly: {how}.{left} "
                f"{ADVICE}" + (f"\nStacks:\n{stacks}" if stacks else ""),
                {"kind": "unclean_shutdown", "exits": [dataclasses.asdict(end) for end in self.unclean],
                 "leaks": self.leaks, "thread_grace_s": self.thread_grace_s, "entries": entries})
        advice = f" {ENTRIES_ADVICE}" if any(leak.startswith(ENTRIES) for leak in self.leaks) else ""
        return CheckFailure(f"{architecture} started and shut down at tensor_parallel_size={tp}, but left behind: "
                            f"{'; '.join(self.leaks)}.{advice}", {"kind": "leak", "leaks": self.leaks,
                                                                  "entries": entries})


ENTRIES = "entries "  # how a leak of entries in /tmp or the working directory starts
KEPT = ("torchinductor_", "__pycache__")  # made on first use and kept on purpose: torch's caches (leaks.py), bytecode


def _kept(path: str) -> bool:
    """Whether ``path`` is kept on purpose: a cache torch or Python makes on first use, or the one holding engine_ref's
    ModelInfo cache (ENGINE_REF_CACHE_ROOT, which a test run may point at a directory not made yet)."""
    from engine_ref.envs import cache_root

    cache = os.path.realpath(cache_root())
    return os.path.basename(path).startswith(KEPT) or cache == path or cache.startswith(path + os.sep)


_ENDS: list[EngineEnd] = []  # the engines this check process started, in order (reset by reported_after)
_watched_by: list[int] = []  # the pid that made this process's private temp dir (watch_only_this_engine), once


class EngineWatch:
    """One engine's life under watch, from before its start (construct this first) to ``finish``, which records how
    it ended, or ``cancel`` (it failed to start, or the block that used it raised: that failure is the finding)."""

    def __init__(self, ctx: CheckContext, tp: int) -> None:
        self.tensor_parallel_size = tp
        if os.getpid() not in _watched_by:  # once per check process: a private TMPDIR, and a child subreaper
            watch_only_this_engine(ctx.workdir)
            _watched_by[:] = [os.getpid()]
        self.entries = EntryWatch()  # first: its descriptors are then in the snapshot, as they are at the end
        with self.entries.paused():
            self.before = ResourceSnapshot.take(watch=True)

    def cancel(self) -> None:
        """Stop watching without a verdict."""
        self.entries.stop()
        if self.before.shm_watch is not None:
            self.before.shm_watch.foreign()  # stops its thread

    def finish(self, llm: Any) -> EngineEnd:
        """After ``llm`` shut down: how its workers ended and what it left; recorded for the check's verdict."""
        engine = llm.engine
        with self.entries.paused():
            leaks = wait_for_no_leaks(self.before)
        entries = self.entries.stop(also_ours=[end.pid for end in engine.worker_exits])
        for directory in entries.watched:
            made = sorted(os.path.basename(path) for path in entries.ours
                          if os.path.dirname(path) == directory and not _kept(path))
            if made:
                leaks.append(f"{ENTRIES}{made} in {directory}, made by its processes")
        unclean = [e for e in engine.worker_exits if not e.clean]
        end = EngineEnd(self.tensor_parallel_size, unclean, leaks, engine.executor.thread_grace_s, entries)
        _ENDS.append(end)
        return end

    def around(self, llm: Any) -> WatchedEngine:
        """``llm``, whose shutdown at the end of its ``with`` block finishes this watch."""
        return WatchedEngine(llm, self)


class WatchedEngine:
    """The engine ``start_engine`` returns: every attribute is the LLM's; leaving its ``with`` block shuts it down
    and finishes its EngineWatch (cancels it when the block raised)."""

    def __init__(self, llm: Any, watch: EngineWatch) -> None:
        self._llm = llm
        self._watch = watch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def __enter__(self) -> WatchedEngine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._llm.__exit__(exc_type, exc, tb)
        except BaseException:
            self._watch.cancel()
            raise
        if exc_type is None:
            self._watch.finish(self._llm)
        else:
            self._watch.cancel()


def reported_after(run: CheckFunction) -> CheckFunction:
    """``run`` with the leftovers of the engines it starts in its verdict: after its own failure (added to it), or
    instead of its pass (the first engine that left something); a pass says what was watched, and what not and why."""

    @functools.wraps(run)
    def checked(ctx: CheckContext) -> dict[str, Any]:
        _ENDS.clear()
        try:
            detail = run(ctx)
        except CheckFailure as failure:
            left = [end for end in _ENDS if not end.clean]
            if left:
                also = left[0].failure(ctx.architecture)
                failure.message += f"\nIt also left things behind: {also.message.splitlines()[0]}"
                failure.detail = {**failure.detail, "leftovers": also.detail}
            raise
        left = [end for end in _ENDS if not end.clean]
        if left:
            found = left[0].failure(ctx.architecture)
            found.detail["engines_left_something"] = f"{len(left)} of {len(_ENDS)}"
            raise found
        if not _ENDS:
            return detail
        return {**detail, "leftovers": {"engines": len(_ENDS), "entries": _ENDS[-1].entries.summary()}}

    return checked
