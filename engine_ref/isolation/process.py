"""The lifecycle of one warm child: start it, read its stacks, kill its whole tree, reap it."""

from __future__ import annotations

import faulthandler
import fcntl
import gc
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from engine_ref.errors import ConfigError
from engine_ref.isolation.context import (
    PRELOAD_MODULES,
    MPContext,
    cuda_initialized,
    enter_isolated_group,
    get_mp_context,
    in_isolated_group,
    launching,
)
from engine_ref.isolation.tempdirs import inherit, owner_dir
from engine_ref.isolation.wait import read_burst

_death_pipe: Connection | None = None  # kept open for the life of the child
_started_at: float | None = None  # time.monotonic() at the child's first instruction (None: not a child of ours)


@dataclass
class _ChildSetup:
    env: dict[str, str]
    pgid: int  # 0: lead a new group
    death_r: Connection
    stack_w: Connection
    tmp_dir: str  # the owner's temp dir (engine_ref.isolation.tempdirs): the child's tempfile.tempdir
    death_w: Connection | None = None  # set under "fork" only: the inherited copy to close in the child


def _arm_death_pipe(death_r: Connection) -> None:
    """Have the kernel SIGIO this process group (or this process) once the parent's end closes."""
    global _death_pipe
    _death_pipe = death_r
    fd = death_r.fileno()
    leads_group = os.getpgrp() == os.getpid()
    fcntl.fcntl(fd, fcntl.F_SETOWN, -os.getpgrp() if leads_group else os.getpid())
    signal.signal(signal.SIGIO, signal.SIG_DFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    if death_r.poll():  # the parent died before the pipe was armed
        os.kill(0 if leads_group else os.getpid(), signal.SIGIO)


def _child_main(setup: _ChildSetup, target: Callable[..., Any], args: tuple) -> None:
    global _started_at
    _started_at = time.monotonic()
    # Everything inherited from the warm parent is long-lived: keep the collector from walking it,
    # which would write to every object's header and copy most of the parent's pages (~10 ms).
    gc.freeze()
    os.environ.clear()
    os.environ.update(setup.env)
    try:
        os.setpgid(0, setup.pgid)
    except OSError:  # the caller's group is gone or in another session: lead our own
        os.setpgid(0, 0)
    enter_isolated_group()
    inherit(setup.tmp_dir)
    if cuda_initialized():
        raise RuntimeError(
            f"the warm parent of this {multiprocessing.get_start_method()} child has initialized CUDA, so the "
            f"child cannot use it; a preloaded module ({', '.join(PRELOAD_MODULES)}) touched CUDA at import.")
    if setup.death_w is not None:
        setup.death_w.close()
    faulthandler.enable(all_threads=True)  # a segfault leaves the Python stacks on stderr
    faulthandler.register(signal.SIGUSR1, file=setup.stack_w.fileno(), all_threads=True)
    _arm_death_pipe(setup.death_r)
    target(*args)


def child_started_at() -> float | None:
    """``time.monotonic()`` (one clock for every process of the host) when this child of ``start_process``
    ran its first instruction of ours; None in a process that was not started so."""
    return _started_at


def _is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (state T: SIGSTOP, SIGTSTP; t: a debugger), from /proc (False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def request_stacks(pid: int) -> str | None:
    """Ask ``pid`` to dump its Python stacks (SIGUSR1 to its faulthandler): None if it is gone, else a note.

    A stopped process runs no handler until it is continued, so it is continued (SIGCONT) right after
    the request: the stacks still show where it stopped. Callers kill it next. The note says so.
    """
    stopped = _is_stopped(pid)
    try:
        os.kill(pid, signal.SIGUSR1)
        if stopped:
            os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return None
    return "It was stopped (SIGSTOP, or a debugger); continued to dump its stacks.\n" if stopped else ""


class WarmProcess:
    """A child started by ``start_process``: its Process, plus stack dumps and whole-tree kill."""

    def __init__(self, process: multiprocessing.process.BaseProcess, death_w: Connection, stack_r: Connection,
                 leads_group: bool) -> None:
        self.process = process
        self._death_w = death_w
        self._stack_r = stack_r
        self._leads_group = leads_group

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def dump_stacks(self, wait_s: float = 1.0) -> str:
        """The child's Python stacks (all threads), via faulthandler; empty if it is already gone."""
        note = request_stacks(self.pid)
        return "" if note is None else note + read_burst(self._stack_r.fileno(), wait_s)

    def kill_tree(self) -> None:
        """SIGKILL the child and, when it leads its own process group, everything it started."""
        if self.process.pid is None:
            return
        try:
            if self._leads_group:
                os.killpg(self.pid, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self) -> None:
        if self.process.is_alive():
            self.process.terminate()

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)

    def close(self, grace_s: float = 0.0) -> None:
        """Reap the child (after ``grace_s`` to exit, then by SIGKILL to its group) and close its pipes."""
        if self.process.pid is not None:
            if grace_s:
                self.process.join(grace_s)
            if self.process.is_alive():
                self.kill_tree()
            self.process.join()
            if self._leads_group:  # stragglers the child started and left in its group
                with suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, signal.SIGKILL)
        for conn in (self._death_w, self._stack_r):
            conn.close()
        self.process.close()


def start_process(target: Callable[..., Any], *args: Any, name: str = "engine_ref-child",
                  ctx: MPContext | None = None) -> WarmProcess:
    """Start ``target(*args)`` in a warm child (see ``engine_ref.isolation``); arguments must pickle.

    Connections among ``args`` are passed to the child; the caller should close its own copies of
    the ends it gave away.
    """
    ctx = ctx or get_mp_context()
    death_r, death_w = ctx.Pipe(duplex=False)
    stack_r, stack_w = ctx.Pipe(duplex=False)
    pgid = os.getpgrp() if in_isolated_group() else 0
    setup = _ChildSetup(env=dict(os.environ), pgid=pgid, death_r=death_r, stack_w=stack_w, tmp_dir=owner_dir(),
                        death_w=death_w if ctx.get_start_method() == "fork" else None)
    process = ctx.Process(target=_child_main, args=(setup, target, args), name=name, daemon=False)
    try:
        with launching():
            process.start()
    except OSError as e:
        if "AF_UNIX path too long" not in str(e):
            raise
        raise ConfigError(
            f"the warm parent's Unix socket cannot be created under TMPDIR={tempfile.gettempdir()!r}: the path "
            f"is longer than a Unix socket allows (108 bytes). Set TMPDIR to a shorter directory, e.g. /tmp."
        ) from None
    death_r.close()
    stack_w.close()
    return WarmProcess(process, death_w, stack_r, leads_group=pgid == 0)
