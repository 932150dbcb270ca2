"""What a process owns that an engine could leave behind: child processes, open file descriptors,
listening sockets, temp-dir entries, shared-memory segments. Read from /proc (Linux), no psutil."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from pytest_enginecheck.entry_watch import EntryWatch


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (zombies excluded)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def command_line(pid: int, limit: int = 160) -> str:
    """``pid``'s command line as a shell would read it (cut at ``limit`` characters), or why it cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [os.fsdecode(arg) for arg in f.read().split(b"\0")[:-1]]
    except OSError:
        return "(gone)"
    line = shlex.join(argv) if argv else "(no command line: a kernel thread or a zombie)"
    return line if len(line) <= limit else f"{line[:limit - 3]}..."


def describe_processes(pids: list[int]) -> str:
    """``[12, 34] (12: python -c 'import time; time.sleep(60)'; 34: sleep 60)``."""
    return f"{pids} ({'; '.join(f'{pid}: {command_line(pid)}' for pid in pids)})"


def _fds() -> dict[int, str]:
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
    return fds


def _listening_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A":  # LISTEN
                        inodes.add(parts[9])
        except OSError:
            pass
    return inodes


SHM_DIR = "/dev/shm"  # POSIX shared memory: segments (shm_open, Python's SharedMemory) and named semaphores

# Per-user caches that torch creates in the temp dir on first use and keeps on purpose.
_PERSISTENT_CACHES = ("torchinductor_",)


def temp_entries(root: str | None = None) -> set[str]:
    """The entries of the temp dir ``root`` (default: the current one), with this process's own temp dir
    (engine_ref.isolation.tempdirs, kept for the process's life) listed by what it holds: ``<dir>/<entry>``."""
    from engine_ref.isolation.tempdirs import own_dir_in

    root = root or tempfile.gettempdir()
    own = own_dir_in(root)
    entries = {name for name in _listdir(root) if not name.startswith(_PERSISTENT_CACHES) and name != own}
    return entries | ({f"{own}/{name}" for name in _listdir(os.path.join(root, own))} if own else set())


def unowned_shm_entries(ours: set[int] | None = None) -> set[str]:
    """The /dev/shm entries no process outside ``ours`` (default: this process and its descendants)
    holds open or mapped: /dev/shm is machine-wide, and a segment another program is using (torch's
    ``psm_*``, multiprocessing's ``sem.mp-*``) is not this engine's leak; a leaked one is held by no one."""
    ours = {os.getpid(), *descendants(os.getpid())} if ours is None else ours
    entries = _inodes(SHM_DIR)
    held = _held_shm_inodes(ours)
    return {name for name, inode in entries.items() if inode not in held}


PYTHON_SHM_PREFIX = "psm_"  # multiprocessing.shared_memory's names: a SharedMemory(create=True) is registered with
# Python's resource tracker, which one process tree shares (the warm parent's forkserver passes its tracker on)


def remove_left_segments(names: Iterable[str]) -> list[str]:
    """Unlink each /dev/shm entry of ``names`` that no process holds: what a process that left by os._exit, or was
    killed, never unlinked (vLLM's rank 0 creates its TP group's shared-memory broadcast as a Python SharedMemory).
    A Python SharedMemory's name is then unregistered from the resource tracker this process shares with it, which
    would otherwise report it at the end of the run ("There appear to be N leaked shared_memory objects") and unlink
    it only then. Returns the names removed."""
    from multiprocessing import resource_tracker

    unheld = unowned_shm_entries(set())
    removed = []
    for name in sorted(set(names) & unheld):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            continue
        removed.append(name)
        # only a tracker this process shares: unregistering would otherwise start one that never knew the name
        if name.startswith(PYTHON_SHM_PREFIX) and getattr(resource_tracker._resource_tracker, "_fd", None) is not None:
            resource_tracker.unregister(f"/{name}", "shared_memory")
    return removed


def _held_shm_inodes(ours: set[int]) -> set[int]:
    """The inodes of the /dev/shm entries that a process outside ``ours`` holds open or mapped."""
    held: set[int] = set()  # by inode: glibc's sem_open maps a temp file and links it to its name afterwards, so
    for pid in (int(e) for e in os.listdir("/proc") if e.isdigit()):  # maps shows the temp name, never that one
        if pid in ours:
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                held.update(int(line.split()[4]) for line in f if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                    held.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except (OSError, ValueError, IndexError):  # gone, or not ours to read
            continue
    return held


class ForeignShmWatch:
    """While an engine runs: the /dev/shm entries that appeared and that are another program's, by either of two
    signs. The kernel named their maker, a process outside this one's tree (an EntryWatch on /dev/shm: fanotify,
    where this process may read it); or a process outside the tree held them at some moment (polled every
    ``interval_s`` in a daemon thread, a /proc scan only when a new entry is there). Another program's segment left
    unheld before the engine stops (another pytest-xdist worker's vLLM ranks leaving by os._exit, torch's ``psm_*``)
    would otherwise read as this engine's leak; a segment this tree made, or one neither sign marks, stays ours."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self._made = EntryWatch([SHM_DIR])
        self._before = set(_inodes(SHM_DIR).values())
        self._foreign: set[int] = set()
        self._looking = threading.Lock()  # held while a look has /proc files open
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(interval_s,), name="enginecheck-shm-watch",
                                        daemon=True)
        self._thread.start()

    def _poll(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.look()

    def look(self) -> None:
        """Record which of the entries new since the start a process outside this tree holds now."""
        with self._looking:
            new = set(_inodes(SHM_DIR).values()) - self._before - self._foreign
            if new:
                self._foreign |= new & _held_shm_inodes({os.getpid(), *descendants(os.getpid())})

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No look while the block runs: a snapshot of this process's file descriptors taken in it does not see
        the /proc files a look holds open."""
        with self._looking, self._made.paused():
            yield

    def seen(self) -> set[int]:
        """Look once more and return the inodes of the new entries another program made or held so far; the watch
        goes on (its descriptors stay open, as in the snapshot taken when it began)."""
        self.look()
        return self._foreign | _inodes_of(self._made.made().foreign)

    def foreign(self) -> set[int]:
        """Stop watching, look once more and return the inodes of the new entries another program made or held."""
        self._stop.set()
        self._thread.join()
        self.look()
        return self._foreign | _inodes_of(self._made.stop().foreign)


def _inodes_of(paths: Iterable[str]) -> set[int]:
    """The inode numbers of the /dev/shm entries at ``paths`` that are still there."""
    now = _inodes(SHM_DIR)
    return {now[name] for name in map(os.path.basename, paths) if name in now}


def _inodes(path: str) -> dict[str, int]:
    """The entries of directory ``path`` by name, with their inode numbers."""
    found = {}
    for name in _listdir(path):
        with contextlib.suppress(OSError):  # removed meanwhile
            found[name] = os.stat(os.path.join(path, name), follow_symlinks=False).st_ino
    return found


def _listdir(path: str) -> set[str]:
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


@dataclass(frozen=True)
class ResourceSnapshot:
    """What this process owns at one moment."""

    children: frozenset[int]
    fds: dict[int, str]
    listening: frozenset[str]  # socket inodes of this process in LISTEN state
    temp_entries: frozenset[str]
    # every /dev/shm entry; whether a new one is held by another program is looked up only when comparing, and only
    # when there is one (a look reads every process's maps: ~0.5 s on a busy machine)
    shm_entries: frozenset[str]
    # of the snapshot taken before an engine runs: who else held the segments that appear meanwhile
    shm_watch: ForeignShmWatch | None = field(default=None, compare=False)

    @classmethod
    def take(cls, watch: bool = False) -> ResourceSnapshot:
        """What this process owns now; with ``watch``, the snapshot to compare the end of an engine's run with
        (``leaked_since``): /dev/shm is watched from now on (ForeignShmWatch)."""
        shm_watch = ForeignShmWatch() if watch else None
        with shm_watch.paused() if shm_watch is not None else contextlib.nullcontext():
            fds = _fds()  # with the watch's own descriptors, as at the end; not the /proc files its looks open
        own_sockets = {target[8:-1] for target in fds.values() if target.startswith("socket:[")}
        return cls(frozenset(descendants(os.getpid())), fds, frozenset(own_sockets & _listening_inodes()),
                   frozenset(temp_entries()), frozenset(_listdir(SHM_DIR)), shm_watch)

    def leaked_since(self, before: ResourceSnapshot, ignore_regular_files: bool = False) -> list[str]:
        """Plain descriptions of what exists now but did not before.

        ``ignore_regular_files`` counts only pipes, sockets and anonymous inodes among new file
        descriptors (a test may legitimately keep its own files open).
        """
        leaks = []
        if self.children - before.children:
            leaks.append(f"child processes {describe_processes(sorted(self.children - before.children))}")
        new_fds = {fd: target for fd, target in self.fds.items() if before.fds.get(fd) != target
                   and not (ignore_regular_files and target.startswith("/"))}
        if new_fds:
            leaks.append(f"open file descriptors {new_fds}")
        if self.listening - before.listening:
            leaks.append(f"listening sockets (inodes {sorted(self.listening - before.listening)})")
        if self.temp_entries - before.temp_entries:
            leaks.append(f"temp entries {sorted(self.temp_entries - before.temp_entries)} in {tempfile.gettempdir()}")
        new_shm = set(self.shm_entries - before.shm_entries)
        if new_shm:
            new_shm &= unowned_shm_entries()
        if new_shm and before.shm_watch is not None:
            foreign, inodes = before.shm_watch.seen(), _inodes(SHM_DIR)
            # one removed meanwhile (its maker, still running, unlinked it) is gone, not left behind
            new_shm = {name for name in new_shm if name in inodes and inodes[name] not in foreign}
        if new_shm:
            leaks.append(f"shared-memory segments {sorted(new_shm)} in /dev/shm")
        return leaks


def wait_for_no_leaks(before: ResourceSnapshot, timeout_s: float = 3.0, ignore_regular_files: bool = False
                      ) -> list[str]:
    """Leaks still present after giving exiting children ``timeout_s`` to be reaped."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with before.shm_watch.paused() if before.shm_watch is not None else contextlib.nullcontext():
                after = ResourceSnapshot.take()
            leaks = after.leaked_since(before, ignore_regular_files)
            if not leaks or time.monotonic() > deadline:
                return leaks
            time.sleep(0.05)
    finally:
        if before.shm_watch is not None:
            before.shm_watch.foreign()  # stops its thread


def watch_only_this_engine(workdir: str) -> None:
    """Make what this check process and its workers leave behind findable, and only that.

    A private temp dir: the shared one also receives other processes' entries (another xdist
    worker's engines, other jobs). Child subreaper: a process a worker started and left running
    is re-parented to this process instead of init, so it is still found among our descendants.
    """
    os.environ["TMPDIR"] = tempfile.mkdtemp(dir=workdir, prefix=".startup-tmp-")
    tempfile.tempdir = None
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER (Linux)
