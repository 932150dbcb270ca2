"""What every vLLM engine a check starts leaves behind (load, budget, lora, quant, startup: all start theirs through
``steps.start``), and the check's verdict on it: engine_ref's ``leftovers.py`` for the vLLM target.

``watched`` spans one start: the ranks' fork, vLLM's start, the requests, the shutdown and the ranks' exit. Before the
check's first, its process gets a private TMPDIR directly in /tmp (vLLM binds ZeroMQ IPC sockets there, under the
107-byte limit of a socket's path; removed when the check ends) and becomes a child subreaper
(``leaks.watch_only_this_engine``). Before each start it takes its resource snapshot (child
processes, open descriptors, listening sockets, the private temp dir's entries, /dev/shm) and starts an EntryWatch on
/tmp and the working directory (``entry_watch``: the entries this process's tree makes there, told apart from a
neighbour's by the pid of their maker, so pytest-xdist workers beside it raise no false alarm). After it, what is
left goes into ``EngineRun.leftovers`` (a process left running is then killed); ranks that did not exit by themselves
are already in ``killed_ranks`` (``engine/ranks.py``). Both travel with the run, which load and budget share.

The verdict comes after the check's own (``reported_after``): a check that fails keeps its failure, with what the
engine left added; a check that passes fails on the first engine that left something, naming the rank and its stacks,
the process, the file.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.targets.vllm.engine.drive import EngineRun

ADVICE = ("A rank must exit once vLLM shuts down: stop and join the threads the model starts (or make them daemon "
          "threads).")
ENTRIES_ADVICE = ("Write an engine's files under tempfile.gettempdir() (each engine gets its own) and remove them by "
                  "the time it shuts down, never at a fixed path in /tmp or in the working directory.")
ENTRIES = "entries "  # how a leftover of entries in /tmp or the working directory starts
# Made on first use and kept on purpose: torch's caches, bytecode, and the lock TP>1 engines take turns on.
KEPT = ("torchinductor_", "__pycache__", "pytest-enginecheck-vllm-multirank.lock")

_RUNS: list[EngineRun] = []  # the engine runs this check used, started or shared (reset by reported_after)


_PRIVATE: dict[int, tuple[str, str | None]] = {}  # pid -> (its private TMPDIR, the TMPDIR before it), once per process


def _private_tmpdir() -> str:
    """This check process's private TMPDIR, made on its first engine start (``leaks.watch_only_this_engine``) and
    kept until ``release``: one for all its starts, since what a start caches of ``tempfile.gettempdir()`` (torch's
    inductor cache directory) is used again by the next."""
    pid = os.getpid()
    if pid not in _PRIVATE:  # also in a fork of a process that had one: that one is its parent's
        from pytest_enginecheck.leaks import watch_only_this_engine

        before = os.environ.get("TMPDIR")
        watch_only_this_engine("/tmp" if os.path.isdir("/tmp") else os.getcwd())
        _PRIVATE.clear()
        _PRIVATE[pid] = (os.environ["TMPDIR"], before)
    return _PRIVATE[pid][0]


def release() -> None:
    """Remove this process's private TMPDIR (what its engines left there was reported) and put TMPDIR back."""
    private, before = _PRIVATE.pop(os.getpid(), ("", None))
    if not private:
        return
    shutil.rmtree(private, ignore_errors=True)
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None


@contextlib.contextmanager
def watched() -> Iterator[list[str]]:
    """Around one engine start: yields the list that, once the block ends without an error, holds what it left."""
    from pytest_enginecheck.entry_watch import EntryWatch
    from pytest_enginecheck.leaks import ResourceSnapshot, wait_for_no_leaks

    left: list[str] = []
    private = _private_tmpdir()
    entries = EntryWatch()  # first: its descriptors are then in the snapshot, as they are at the end
    try:
        with entries.paused():
            before = ResourceSnapshot.take(watch=True)
        try:
            yield left
        except BaseException:
            if before.shm_watch is not None:
                before.shm_watch.foreign()  # stops its thread
            raise
        with entries.paused():
            left.extend(wait_for_no_leaks(before, ignore_regular_files=True))
        _kill_left_processes(before.children)
        made = entries.stop()
        for directory in made.watched:
            names = sorted(os.path.basename(p) for p in made.ours if os.path.dirname(p) == directory
                           and p != private and not os.path.basename(p).startswith(KEPT))
            if names:
                left.append(f"{ENTRIES}{names} in {directory}, made by its processes")
    finally:
        entries.stop()


def _kill_left_processes(before: frozenset[int]) -> None:
    """SIGKILL what the engine left running (reported already): this process's descendants that were not there before
    it started (re-parented here, the child subreaper, when their parent exited)."""
    from pytest_enginecheck.leaks import descendants

    for pid in descendants(os.getpid()) - before:
        with contextlib.suppress(ProcessLookupError, PermissionError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, os.WNOHANG)


def used(run: EngineRun) -> EngineRun:
    """Record that this check's verdict rests on ``run`` (started or shared); returns it."""
    _RUNS.append(run)
    return run


def failure(architecture: str, run: EngineRun) -> CheckFailure | None:
    """What ``run`` left, as a failure in startup's words (ranks killed after the shutdown grace first, with their
    stacks), or None when it left nothing."""
    from pytest_enginecheck.targets.vllm.engine.ranks import SHUTDOWN_GRACE_S

    where = f"{architecture} started, generated and shut down at tensor_parallel_size={run.tp} ({run.dtype})"
    if run.killed_ranks:
        ranks = ", ".join(str(k["rank"]) for k in run.killed_ranks)
        also = f" It also left behind: {'; '.join(run.leftovers)}." if run.leftovers else ""
        stacks = "\n".join(f"rank {k['rank']}:\n{k['stacks'].rstrip()}" for k in run.killed_ranks)
        return CheckFailure(
            f"{where}, but rank {ranks} did not exit by itself within {SHUTDOWN_GRACE_S:g} s and was killed.{also} "
            f"{ADVICE} Its Python stacks before the kill (a non-daemon thread of the model's is what keeps it "
            f"alive):\n{stacks}",
            {"kind": "unclean_shutdown", "killed_ranks": run.killed_ranks, "leaks": run.leftovers,
             "grace_s": SHUTDOWN_GRACE_S})
    if run.leftovers:
        advice = f" {ENTRIES_ADVICE}" if any(leak.startswith(ENTRIES) for leak in run.leftovers) else ""
        return CheckFailure(f"{where}, but left behind: {'; '.join(run.leftovers)}.{advice}",
                            {"kind": "leak", "leaks": run.leftovers})
    return None


def reported_after(check: Callable[[CheckContext], dict[str, Any]]) -> Callable[[CheckContext], dict[str, Any]]:
    """``check`` with what the engines it used left in its verdict: added to its own failure, or instead of its pass
    (the first engine that left something)."""

    @functools.wraps(check)
    def run(ctx: CheckContext) -> dict[str, Any]:
        _RUNS.clear()
        try:
            detail = check(ctx)
        except CheckFailure as own:
            found = next((f for f in (failure(ctx.architecture, r) for r in _RUNS) if f is not None), None)
            if found is not None:
                own.message += f"\nIt also left things behind: {found.message.splitlines()[0]}"
                own.detail = {**own.detail, "leftovers": found.detail}
            raise
        finally:
            release()
        found = next((f for f in (failure(ctx.architecture, r) for r in _RUNS) if f is not None), None)
        if found is not None:
            raise found
        return detail

    return run
