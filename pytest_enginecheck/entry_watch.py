"""Which entries of the shared directories an engine's processes make: the system temp dir (/tmp) and the working
directory, which every process of the machine writes to (other pytest-xdist workers, other engines, other jobs).

A name that appears there is this engine's only if one of its processes made it, and the kernel can say which:
fanotify (Linux 5.9+, ``FAN_REPORT_DFID_NAME``) reports every entry made in a marked directory (a file, a directory,
a socket, a link; created or renamed in) with the pid of the process that made it. The watch reads the events as
they come, in a thread, and looks the pid up while its process still runs: made by ``root`` (the check's process)
or a descendant of it (a child subreaper: what its workers start and leave is re-parented to it) is ours; any other
process is not, however many run beside it. An entry removed later is forgotten; what is left when the watch stops,
made by one of ours, is a leftover.

The alternatives, and why not: inotify names no process (a neighbour's file would be a false alarm); a private mount
namespace with its own /tmp changes what the engine sees (the session's files live in /tmp, and a file, a lock or a
socket another process looks for would be split in two); the owner and the time of an entry cannot tell two workers
of the same user apart; /proc/<pid>/fd shows only the files still open.

What it cannot tell, it says: an entry whose maker had exited and been reaped before its event was read (a helper
that lives for milliseconds) is ``unattributed``, never a leftover; without fanotify's pids (no CAP_SYS_ADMIN: the
kernel then reports other processes' events with pid 0), on a kernel before 5.9, off Linux or on a filesystem
without file handles, ``not_watched`` names each directory and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import struct
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

# <linux/fanotify.h>
FAN_CLOEXEC, FAN_NONBLOCK, FAN_REPORT_DFID_NAME = 0x1, 0x2, 0x400 | 0x800
FAN_MARK_ADD, FAN_MARK_ONLYDIR = 0x1, 0x8
FAN_MOVED_FROM, FAN_MOVED_TO, FAN_CREATE, FAN_DELETE = 0x40, 0x80, 0x100, 0x200
FAN_Q_OVERFLOW, FAN_ONDIR = 0x4000, 0x40000000
FAN_EVENT_INFO_TYPE_DFID_NAME = 2
AT_FDCWD = -100
CAP_SYS_ADMIN = 21
_METADATA = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
_INFO = struct.Struct("=BBH")  # info_type, pad, len
_FID_HEAD = _INFO.size + 8  # the info header, then the fsid
_HANDLE = struct.Struct("=Ii")  # handle_bytes, handle_type; then the handle, then the entry's name
_MADE, _GONE = FAN_CREATE | FAN_MOVED_TO, FAN_DELETE | FAN_MOVED_FROM

OURS, FOREIGN, EXITED, WITHHELD = "ours", "foreign", "exited", "withheld"  # who made an entry, as the watch saw it


def shared_dirs() -> list[str]:
    """The directories every process writes to that a check watches: /tmp and the working directory (real paths,
    each once)."""
    found: list[str] = []
    for path in ("/tmp", os.getcwd()):
        real = os.path.realpath(path)
        if os.path.isdir(real) and real not in found:
            found.append(real)
    return found


def _has_pids() -> str | None:
    """Why fanotify would withhold the pid of another process's event here, or None when it reports them: it does
    only to a listener with CAP_SYS_ADMIN in the initial user namespace."""
    try:
        with open("/proc/self/status") as f:
            caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
        with open("/proc/self/uid_map") as f:
            initial = f.read().split() == ["0", "0", "4294967295"]
    except (OSError, StopIteration, ValueError):
        return "its capabilities cannot be read from /proc"
    if not caps >> CAP_SYS_ADMIN & 1:
        return ("fanotify names the process that made an entry only to a process with CAP_SYS_ADMIN, which this "
                "one lacks (run the checks as root, or in a container given CAP_SYS_ADMIN)")
    if not initial:
        return ("fanotify names the process that made an entry only to a process with CAP_SYS_ADMIN in the initial "
                "user namespace, and this one runs in another")
    return None


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
    libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
    return libc


class FanotifyError(OSError):
    """fanotify_init or fanotify_mark (``call``) refused; ``reason()`` says why in a user's words."""

    def __init__(self, call: str, code: int) -> None:
        super().__init__(code, os.strerror(code))
        self.call = call

    def reason(self) -> str:
        """Why a directory is not watched, with the call and its error."""
        text = f"{self.call} failed: {self.strerror} ({errno.errorcode.get(self.errno or 0, self.errno)})"
        if self.errno == errno.EINVAL and self.call == "fanotify_init":
            return f"this kernel's fanotify cannot report the names of new entries (it needs Linux 5.9+): {text}"
        if self.errno in (errno.EMFILE, errno.ENFILE):
            return f"no fanotify group is left (fs.fanotify.max_user_groups): {text}"
        if self.errno in (errno.EXDEV, errno.EOPNOTSUPP, errno.ENODEV):
            return f"its filesystem gives fanotify no file handles: {text}"
        return text


def _open_group(libc: ctypes.CDLL, directory: str) -> int:
    """A fanotify group that reports the entries made and removed in ``directory``; FanotifyError when it cannot."""
    fd = libc.fanotify_init(FAN_CLOEXEC | FAN_NONBLOCK | FAN_REPORT_DFID_NAME, os.O_RDONLY)
    if fd < 0:
        raise FanotifyError("fanotify_init", ctypes.get_errno())
    mask = _MADE | _GONE | FAN_ONDIR
    if libc.fanotify_mark(fd, FAN_MARK_ADD | FAN_MARK_ONLYDIR, mask, AT_FDCWD, os.fsencode(directory)) < 0:
        code = ctypes.get_errno()
        os.close(fd)
        raise FanotifyError("fanotify_mark", code)
    return fd


def parse_events(buffer: bytes) -> list[tuple[int, int, str | None]]:
    """The (mask, pid, entry name) of each event in what one read of a ``FAN_REPORT_DFID_NAME`` group returned."""
    events = []
    offset = 0
    while offset + _METADATA.size <= len(buffer):
        length, _, _, metadata_len, mask, _, pid = _METADATA.unpack_from(buffer, offset)
        if length < _METADATA.size:
            break
        name = None
        info = offset + metadata_len
        while info + _INFO.size <= offset + length:
            info_type, _, info_len = _INFO.unpack_from(buffer, info)
            if info_len == 0:
                break
            if info_type == FAN_EVENT_INFO_TYPE_DFID_NAME:
                handle_bytes, _ = _HANDLE.unpack_from(buffer, info + _FID_HEAD)
                start = info + _FID_HEAD + _HANDLE.size + handle_bytes
                name = os.fsdecode(buffer[start:info + info_len].split(b"\0", 1)[0])
            info += info_len
        events.append((mask, pid, name))
        offset += length
    return events


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def maker(pid: int, root: int) -> str:
    """Whose ``pid`` is: ``root`` or a descendant of it (OURS), another process (FOREIGN), a process no longer
    there (EXITED), or withheld by the kernel (WITHHELD: pid 0)."""
    if pid <= 0:
        return WITHHELD
    seen: set[int] = set()
    current: int | None = pid
    while current is not None and current > 1 and current not in seen:
        if current == root:
            return OURS
        seen.add(current)
        parent = _parent(current)
        if parent is None and current == pid:
            return EXITED
        current = parent
    return FOREIGN


@dataclass(frozen=True)
class MadeEntries:
    """What an EntryWatch found: the entries still there that the tree made (``ours``), those whose maker it could
    not tell (``unattributed``, with why) and those another process made (``foreign``), as paths; the directories
    watched, and why the others were not."""

    ours: tuple[str, ...] = ()
    unattributed: dict[str, str] = field(default_factory=dict)
    watched: tuple[str, ...] = ()
    not_watched: dict[str, str] = field(default_factory=dict)
    foreign: tuple[str, ...] = ()

    def summary(self) -> dict[str, object]:
        """For a check's detail: what was watched, what not and why, what could not be attributed."""
        return {"watched": list(self.watched), "not_watched": {d: f"not watched, because {why}"
                                                               for d, why in self.not_watched.items()},
                **({"unattributed": dict(self.unattributed)} if self.unattributed else {})}


class EntryWatch:
    """From construction to ``stop``: who makes the entries of ``directories`` (default ``shared_dirs()``), and
    which of them ``root`` (default this process) or its descendants made."""

    def __init__(self, directories: Iterable[str] | None = None, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self.directories = list(shared_dirs() if directories is None else directories)
        self.not_watched: dict[str, str] = {}
        self._groups: dict[int, str] = {}  # fanotify fd -> its directory
        self._made: dict[tuple[str, str], tuple[str, int]] = {}  # (directory, name) -> (maker, pid)
        self._overflowed: set[str] = set()
        self._looking = threading.Lock()  # held while the thread reads events and looks their makers up in /proc
        self._thread: threading.Thread | None = None
        why = "fanotify is Linux only" if not sys.platform.startswith("linux") else _has_pids()
        libc = None
        if why is None:
            try:
                libc = _libc()
            except (OSError, AttributeError) as e:
                why = f"libc has no fanotify ({e})"
        for directory in self.directories:
            if libc is None:
                self.not_watched[directory] = why or "fanotify is not available"
                continue
            try:
                self._groups[_open_group(libc, directory)] = directory
            except FanotifyError as e:
                self.not_watched[directory] = e.reason()
        if self._groups:
            self._stop_r, self._stop_w = os.pipe()
            self._thread = threading.Thread(target=self._read_until_stopped, name="enginecheck-entry-watch",
                                            daemon=True)
            self._thread.start()

    def _read_until_stopped(self) -> None:
        while True:
            ready, _, _ = select.select([*self._groups, self._stop_r], [], [])
            self._read(ready)
            if self._stop_r in ready:
                self._read(list(self._groups))  # what came before the stop and after the last read
                return

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No event read while the block runs: a snapshot of this process's file descriptors taken in it does not see
        the /proc files a look-up holds open (leaks.ResourceSnapshot)."""
        with self._looking:
            yield

    def _read(self, fds: Iterable[int]) -> None:
        with self._looking:
            self._read_now(fds)

    def _read_now(self, fds: Iterable[int]) -> None:
        for fd in fds:
            directory = self._groups.get(fd)
            if directory is None:
                continue
            while True:
                try:
                    buffer = os.read(fd, 65536)
                except BlockingIOError:
                    break
                for mask, pid, name in parse_events(buffer):
                    self._record(directory, mask, pid, name)

    def _record(self, directory: str, mask: int, pid: int, name: str | None) -> None:
        if mask & FAN_Q_OVERFLOW:
            self._overflowed.add(directory)
        elif name is not None and mask & _MADE:
            self._made[directory, name] = (maker(pid, self.root), pid)
        elif name is not None and mask & _GONE:
            self._made.pop((directory, name), None)

    def stop(self, also_ours: Iterable[int] = ()) -> MadeEntries:
        """Read the last events and stop; ``also_ours``: pids known to have been the tree's (an engine's workers):
        what they made is ours even when they had exited before the event was read."""
        if self._thread is not None:
            os.write(self._stop_w, b"x")
            self._thread.join()
            self._thread = None
            for fd in (*self._groups, self._stop_r, self._stop_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
        return self.made(also_ours)

    def made(self, also_ours: Iterable[int] = ()) -> MadeEntries:
        """What the watch found so far, the events waiting now read too; it goes on watching (``stop`` ends it)."""
        if self._thread is not None:
            self._read(list(self._groups))
        known = set(also_ours)
        ours, unattributed, foreign = [], {}, []
        for (directory, name), (who, pid) in sorted(self._made.items()):
            path = os.path.join(directory, name)
            if not os.path.lexists(path):
                continue
            if who == OURS or pid in known:
                ours.append(path)
            elif who == FOREIGN:
                foreign.append(path)
            elif who == EXITED:
                unattributed[path] = f"made by pid {pid}, which had exited before it could be told whose it was"
            else:
                unattributed[path] = "made by a process the kernel did not name (pid 0)"
        not_watched = dict(self.not_watched)
        for directory in sorted(self._overflowed):
            not_watched[directory] = "fanotify's event queue overflowed, so an entry made meanwhile may be missed"
        watched = tuple(d for d in self.directories if d not in not_watched)
        return MadeEntries(tuple(ours), unattributed, watched, not_watched, tuple(foreign))
