"""The leak check's view of the machine-wide /dev/shm: a segment another program holds is not a leak, one nobody
holds is."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from pytest_enginecheck.leaks import unowned_shm_entries

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
