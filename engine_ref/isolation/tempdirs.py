"""One temp directory per owner process, named for it, and the sweep of those whose owner is gone.

Every temp entry of an engine or a pytest_enginecheck session lives in one directory per owner
process, ``$TMPDIR/engine_ref-<pid>-<start>-XXXXXXXX``: an engine's rendezvous store,
multiprocessing's ``pymp-*`` directory (the forkserver's socket), the session's tiny checkpoints,
and whatever the owner's children write through ``tempfile`` (their ``tempfile.tempdir`` is the
owner's directory). ``start`` is the owner's start time (clock ticks since boot, from
``/proc/<pid>/stat``), so that a pid the system gave to another process since is not taken for the
owner. The owner removes its directory at exit. An owner that was killed (SIGKILL, or SIGTERM's
default action, which runs no exit handler) cannot, and its children die with it (the death pipe):
the next process that makes its own directory in the same temp dir removes the directories of
owners that are gone. Only names of this shape, only this user's, only owners no longer running.
"""

from __future__ import annotations

import multiprocessing.process
import multiprocessing.util
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

PREFIX = "engine_ref-"
_OWNED = re.compile(rf"^{re.escape(PREFIX)}(\d+)-(\d+)-")
_EXIT_PRIORITY = -200  # after multiprocessing's own temp dir (-100): it lives inside ours

_made: dict[tuple[int, str], str] = {}  # (pid, temp root) -> the directory this process made there
_inherited: str | None = None  # in a child of ours: its owner's directory, its tempfile.tempdir


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot); None if it is gone, 0 where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else _exists(pid)
    except (OSError, IndexError, ValueError):
        return None


def _exists(pid: int) -> int | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0


def owner_alive(pid: int, started: int) -> bool:
    """Whether the process that started at ``started`` still runs as ``pid`` (0: its start time is unknown)."""
    now = start_time(pid)
    return now is not None and (started == 0 or now == 0 or now == started)


def owner_dir() -> str:
    """This process's directory in the current temp dir, made (after a sweep) on first use.

    In a child of ours whose temp dir is still its owner's: that directory.
    """
    root = tempfile.gettempdir()
    if _inherited is not None and os.path.realpath(root) == os.path.realpath(_inherited):
        return _inherited
    key = (os.getpid(), root)
    path = _made.get(key)
    if path is None or not os.path.isdir(path):
        sweep(root)
        path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{start_time(os.getpid()) or 0}-", dir=root)
        _made[key] = path
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                                      exitpriority=_EXIT_PRIORITY)
    return path


def own_dir_in(root: str) -> str | None:
    """The directory this process made in ``root`` with ``owner_dir()``, if any (its name only)."""
    path = _made.get((os.getpid(), root))
    return os.path.basename(path) if path is not None else None


def mkdtemp_beside(tag: str) -> str:
    """A directory of this process's own in the temp dir itself, beside ``owner_dir()``, swept like it.

    For Ray's session files, whose Unix socket paths must stay within 107 bytes.
    """
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{start_time(os.getpid()) or 0}-{tag}-")


def inherit(path: str) -> None:
    """In a child of ours: use the owner's directory ``path`` as this process's temp dir."""
    global _inherited
    _inherited = tempfile.tempdir = path


def adopt_multiprocessing_tempdir() -> None:
    """Have multiprocessing make its ``pymp-*`` directory (the forkserver's socket) inside ``owner_dir()``.

    ``multiprocessing.util.get_temp_dir`` makes it on first use and keeps it in the process's
    ``_config``; one made before (by other code) is left where it is.
    """
    config = multiprocessing.process.current_process()._config  # type: ignore[attr-defined]
    if config.get("tempdir") is None:
        config["tempdir"] = tempfile.mkdtemp(prefix="pymp-", dir=owner_dir())


def sweep(root: str) -> list[str]:
    """Remove the directories in ``root`` of owners that are gone; return their paths."""
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        match = _OWNED.match(name)
        if match is None:
            continue
        path = Path(root, name)
        try:
            info = path.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if not owner_alive(int(match[1]), int(match[2])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed
