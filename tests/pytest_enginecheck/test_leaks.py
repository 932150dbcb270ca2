"""The leak check's view of the machine-wide /dev/shm: a segment another program holds is not a leak, one nobody
holds is."""

from __future__ import annotations

import ast
import ctypes
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_enginecheck.entry_watch import _has_pids
from pytest_enginecheck.leaks import ResourceSnapshot, unowned_shm_entries, wait_for_no_leaks


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A temp dir of this test's own, as the engine checks take one (``watch_only_this_engine``): the shared one
    also receives other xdist workers' entries while the test waits, which are not what these tests are about."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture
def not_a_subreaper() -> Iterator[None]:
    """This process not a child subreaper during the test (an engine check run earlier in this xdist worker made it
    one, as ``watch_only_this_engine`` does): the double-forked program a test starts as another program's is then
    re-parented to init, as another program's is, and not to this process, which would make it ours."""
    libc = ctypes.CDLL(None, use_errno=True)
    was = ctypes.c_int(0)
    libc.prctl(37, ctypes.byref(was), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
    libc.prctl(36, 0, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    try:
        yield
    finally:
        libc.prctl(36, was.value, 0, 0, 0)


# A named POSIX semaphore made as multiprocessing makes its own: glibc's sem_open maps a temp file, then links it to
# the name, so the holder's /proc/PID/maps names the temp file ("(deleted)"), never the semaphore's name.
HOLDER = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.sem_open.restype = ctypes.c_void_p
assert libc.sem_open(sys.argv[1].encode(), os.O_CREAT | os.O_EXCL, 0o600, 0), ctypes.get_errno()
print("ready", flush=True)
time.sleep(60)
"""


def test_a_semaphore_another_process_holds_is_not_a_leak_until_it_is_gone(procs) -> None:
    name = f"ec-test-{uuid.uuid4().hex[:8]}"
    entry = f"sem.{name}"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, f"/{name}"], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    procs.append(holder)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        assert entry in os.listdir("/dev/shm")
        assert entry not in unowned_shm_entries(ours={os.getpid()})
        holder.kill()
        holder.wait()
        assert entry in unowned_shm_entries(ours={os.getpid()})  # left behind, held by no one: a leak
    finally:
        if os.path.exists(f"/dev/shm/{entry}"):
            os.unlink(f"/dev/shm/{entry}")


# Another program, outside this process's tree (a new session whose parent has exited), that creates a segment,
# holds it for a while and leaves it behind unheld: vLLM's ranks leaving by os._exit do this with their all-reduce
# segments. It makes the segment only once it has been re-parented: until its parent exits it is still this process's
# grandchild, and what it made then would rightly be ours (the watch looks its maker up as soon as the event comes).
OUTSIDE_THIS_TREE = """
import os, sys, time
parent = os.getpid()
if os.fork():
    os._exit(0)
while os.getppid() == parent:
    time.sleep(0.001)
"""
FOREIGN = OUTSIDE_THIS_TREE + """
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
time.sleep(0.5)
os.close(fd)
"""


def own_segments(leaks: list[str], path: str) -> list[str]:
    """The /dev/shm leaks naming this test's own segment ``path``: another suite running beside this one makes and
    leaves segments of its own (``ec-test-*`` too, under other names), which are not what the test is about."""
    found = []
    for leak in leaks:
        listed = re.fullmatch(r"shared-memory segments (\[.*\]) in /dev/shm", leak)
        if listed:
            found += [name for name in ast.literal_eval(listed[1]) if name == os.path.basename(path)]
    return found


def _gone(path: str, seconds: float = 30.0) -> None:
    """Wait until ``path`` exists and no process holds it (the foreign program is done with it)."""
    deadline = time.monotonic() + seconds
    while not (os.path.exists(path) and os.path.basename(path) in unowned_shm_entries(ours={os.getpid()})):
        assert time.monotonic() < deadline, f"{path} was not created and released"
        time.sleep(0.05)


# The same program leaving its segment unheld at once (created and closed): no look of the watch sees it held, but the
# kernel names its maker (fanotify), which is still running, outside this tree, when the watch reads the event.
FOREIGN_UNHELD = OUTSIDE_THIS_TREE + """
os.close(os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
time.sleep(0.5)
"""


@pytest.mark.parametrize("program", [
    pytest.param(FOREIGN, id="held"),
    pytest.param(FOREIGN_UNHELD, id="never-held", marks=pytest.mark.skipif(
        _has_pids() is not None, reason=f"fanotify names no process here: {_has_pids()}"))])
@pytest.mark.usefixtures("private_tmp", "not_a_subreaper")
def test_a_segment_another_program_made_and_left_while_the_engine_ran_is_not_the_engines_leak(program: str) -> None:
    path = f"/dev/shm/ec-test-foreign-{uuid.uuid4().hex[:8]}"
    before = ResourceSnapshot.take(watch=True)
    try:
        subprocess.run([sys.executable, "-c", program, path], check=True, start_new_session=True, timeout=60)
        _gone(path)
        time.sleep(0.6)  # the maker has exited: the verdict rests on what the watch saw while it ran
        assert own_segments(wait_for_no_leaks(before, timeout_s=0.1), path) == []
    finally:
        if os.path.exists(path):
            os.unlink(path)


@pytest.mark.usefixtures("private_tmp")
def test_a_segment_only_this_tree_held_is_a_leak_although_the_watch_ran() -> None:
    path = f"/dev/shm/ec-test-own-{uuid.uuid4().hex[:8]}"
    before = ResourceSnapshot.take(watch=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        time.sleep(0.3)  # seen by the watch while held, by this process
        os.close(fd)
        leaks = wait_for_no_leaks(before, timeout_s=0.1)
        assert own_segments(leaks, path) == [os.path.basename(path)], leaks
    finally:
        if os.path.exists(path):
            os.unlink(path)


# A process tree that shares one resource tracker, as the warm parent's forkserver tree does: a forked child creates a
# Python SharedMemory (registered with the tracker) and leaves by os._exit without unlinking it, as vLLM's rank 0 does
# with its TP group's shared-memory broadcast when the rank fails. argv[1]: "remove" to call remove_left_segments.
FORKED_SEGMENT = """
import multiprocessing, os, sys
from multiprocessing import resource_tracker, shared_memory

from pytest_enginecheck.leaks import remove_left_segments


def leave_a_segment(conn):
    conn.send(shared_memory.SharedMemory(create=True, size=4096).name)
    os._exit(0)


resource_tracker.ensure_running()  # before the fork, as the forkserver does: the child shares it
reader, writer = multiprocessing.Pipe(duplex=False)
child = multiprocessing.get_context("fork").Process(target=leave_a_segment, args=(writer,))
child.start()
name = reader.recv()
child.join()
assert os.path.exists(f"/dev/shm/{name}")
print(name, remove_left_segments([name]) if sys.argv[1] == "remove" else "kept", flush=True)
"""


@pytest.mark.parametrize("remove", [True, False])
def test_a_segment_a_forked_process_left_is_removed_and_the_tracker_told(remove: bool) -> None:
    """remove_left_segments unlinks it and unregisters it from the shared tracker, which then has nothing to report
    at the end of the run; without it, the segment stays until then and the tracker reports it."""
    done = subprocess.run([sys.executable, "-c", FORKED_SEGMENT, "remove" if remove else "keep"], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    name, said = done.stdout.split(maxsplit=1)
    assert not os.path.exists(f"/dev/shm/{name}")  # the tracker unlinks what is left when the tree is gone
    if remove:
        assert said.strip() == f"['{name}']" and done.stderr == ""
    else:
        assert "resource_tracker: There appear to be 1 leaked shared_memory objects" in done.stderr
