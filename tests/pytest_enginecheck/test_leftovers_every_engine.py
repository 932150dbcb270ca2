"""What every engine an engine_ref check starts leaves behind (pytest_enginecheck/targets/engine_ref/leftovers.py),
and the entry watch that tells its entries in /tmp and the working directory from a neighbour's
(pytest_enginecheck/entry_watch.py).

The planted bugs of zoo/planted_leftovers.py (zoo.leftovers_registry) run through one ``pytest --enginecheck`` session
of load and startup at TP=2, while a neighbour process outside the session keeps making files in /tmp and in the
session's working directory: each bug fails load[tp=2] naming what was left (the process and its command line, the
thread and its stack, the file), startup fails for the same cause (folded into load[tp=2], its own failure kept in
its detail), each twin passes both, and no neighbour's file is named. The entry watch is also tested alone on real
process trees, and where fanotify cannot name the process that made an entry.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_enginecheck.entry_watch import EntryWatch, _has_pids
from tests.zoo_sessions import ZooSession, shared_dir, zoo_session

ARGS = ("--enginecheck-target=zoo.leftovers_registry:REGISTRY", "--enginecheck-checks=load,startup",
        "--enginecheck-tp=2")
BUGS = ("DecodeHelperLlamaForCausalLM", "DecodeThreadLlamaForCausalLM", "TmpFileLlamaForCausalLM",
        "ShmSegmentLlamaForCausalLM")
TWINS = ("JoinedHelperLlamaForCausalLM", "StoppedThreadLlamaForCausalLM", "RemovedTmpFileLlamaForCausalLM",
         "UnlinkedShmSegmentLlamaForCausalLM")
FANOTIFY = _has_pids()  # None where fanotify names the process that made an entry

# Makes a file in each directory of argv[2:] every 50 ms, each named argv[1]-N, and keeps the last 20 of each.
NEIGHBOUR = """
import itertools, os, sys, time
for i in itertools.count():
    for d in sys.argv[2:]:
        open(os.path.join(d, f"{sys.argv[1]}-{i}"), "w").close()
        if i >= 20:
            os.unlink(os.path.join(d, f"{sys.argv[1]}-{i - 20}"))
    if i == 0:
        print("ready", flush=True)
    time.sleep(0.05)
"""




@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ZooSession, str]]:
    """The session, and the name its neighbour's files start with; what the session's bugs left in /tmp is removed
    (by its tag: ZOO_LEFTOVER_TAG, planted_leftovers.layout_path)."""
    tag = f"ec-test-{uuid.uuid4().hex[:8]}"
    run_dir = shared_dir(tmp_path_factory) / "zoo-session-leftovers"  # the session's working directory
    run_dir.mkdir(exist_ok=True)
    # its files in /dev/shm are shared-memory segments another program made and left unheld meanwhile
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, f"zoo-neighbour-{tag}", "/tmp", str(run_dir),
                                  "/dev/shm"], stdout=subprocess.PIPE, text=True)
    try:
        assert neighbour.stdout is not None and neighbour.stdout.readline() == "ready\n"
        yield zoo_session(tmp_path_factory, "leftovers", *ARGS, env={"ZOO_LEFTOVER_TAG": tag}), f"zoo-neighbour-{tag}"
    finally:
        neighbour.kill()
        neighbour.wait()
        for pattern in (f"/tmp/zoo-neighbour-{tag}-*", f"{run_dir}/zoo-neighbour-{tag}-*",
                        f"/dev/shm/zoo-neighbour-{tag}-*", f"/tmp/zoo-shard-layout-{tag}-*",
                        f"/dev/shm/zoo-shard-layout-{tag}-*"):
            _remove(pattern)


def _result(session: ZooSession, arch: str, item: str) -> dict[str, Any]:
    return session.results[(arch, item)]


def test_each_bug_fails_load_and_startup_naming_what_was_left(session: tuple[ZooSession, str]) -> None:
    zoo, _ = session
    found = {}
    for arch in BUGS:
        load, startup = _result(zoo, arch, "load[tp=2]"), _result(zoo, arch, "startup")
        # startup failed for the same cause as load[tp=2]: one root cause, one failure; its own words are kept
        assert (startup["outcome"], startup["detail"]["kind"]) == ("skipped", "dependency"), startup["message"]
        assert startup["message"] == f"load[tp=2] failed, see enginecheck::{arch}::load[tp=2]"
        assert startup["detail"]["cause"] == load["detail"]["cause"]
        found[arch] = (load, startup["detail"]["failure"])
    load, startup = found["DecodeHelperLlamaForCausalLM"]
    for message in (load["message"], startup):
        assert message.startswith("DecodeHelperLlamaForCausalLM started and shut down at tensor_parallel_size=2, but "
                                  "left behind: child processes ["), message
        assert message.count("-c 'import time; time.sleep(60)  # zoo leftover helper'") == 2, message  # one per rank
    load, startup = found["DecodeThreadLlamaForCausalLM"]
    for message in (load["message"], startup):
        assert message.startswith("DecodeThreadLlamaForCausalLM started at tensor_parallel_size=2, but did not shut "
                                  "down cleanly: rank 0 (pid "), message
        assert "non-daemon thread 'decode-stats-1' (target zoo.planted_leftovers._poll_stats)" in message
        assert "in _poll_stats\n    time.sleep(0.05)" in message  # its stack
    assert load["detail"]["kind"] == "unclean_shutdown"
    load, startup = found["ShmSegmentLlamaForCausalLM"]
    for message in (load["message"], startup):  # one segment per rank, whatever the neighbour made meanwhile
        assert message.startswith("ShmSegmentLlamaForCausalLM started and shut down at tensor_parallel_size=2, but "
                                  "left behind: shared-memory segments ['zoo-shard-layout-"), message
        assert message.count("zoo-shard-layout-") == 2 and "zoo-neighbour" not in message, message
    load, startup = found["TmpFileLlamaForCausalLM"]
    if FANOTIFY is not None:  # not watched here: the pass says so instead
        assert load["outcome"] == "passed"
        assert set(load["detail"]["leftovers"]["entries"]["not_watched"].values()) == {f"not watched, because "
                                                                                       f"{FANOTIFY}"}
        return
    for message in (load["message"], startup):
        assert message.startswith("TmpFileLlamaForCausalLM started and shut down at tensor_parallel_size=2, but left "
                                  "behind: entries ['zoo-shard-layout-"), message
        assert "in /tmp, made by its processes" in message
    assert all(found[arch][0]["outcome"] == "failed" for arch in BUGS)


def test_each_twin_passes_and_no_neighbours_file_is_named(session: tuple[ZooSession, str]) -> None:
    zoo, neighbour = session
    for arch in TWINS:
        for item in ("load[tp=2]", "startup"):
            result = _result(zoo, arch, item)
            assert result["outcome"] == "passed", result["message"]
            entries = result["detail"]["leftovers"]["entries"]
            if FANOTIFY is None:
                assert entries["not_watched"] == {} and "/tmp" in entries["watched"], entries
    assert neighbour not in json.dumps(zoo.report["results"])  # made beside the engines, never theirs


# A process that makes a file and a directory in each directory of argv[3:], and one it removes again, once a line
# comes on stdin; as "engine", a child of it makes a file in each first (a worker). It says "done" and stays until
# its stdin closes, so the watch stops while both trees still run.
TREE = """
import os, subprocess, sys
name, role, *dirs = sys.argv[1:]
sys.stdin.readline()
if role == "engine":
    code = "import os, sys; [open(os.path.join(d, sys.argv[1]), 'w').close() for d in sys.argv[2:]]; print('done', "\
           "flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code, f"{name}-child-file", *dirs], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "done\\n"
for d in dirs:
    open(os.path.join(d, f"{name}-{role}-file"), "w").close()
    os.mkdir(os.path.join(d, f"{name}-{role}-dir"))
    open(os.path.join(d, f"{name}-{role}-gone"), "w").close()
    os.unlink(os.path.join(d, f"{name}-{role}-gone"))
print("done", flush=True)
sys.stdin.read()
"""


def _remove(pattern: str) -> None:
    for path in glob.glob(pattern):
        os.rmdir(path) if os.path.isdir(path) else os.unlink(path)


@pytest.mark.skipif(FANOTIFY is not None, reason=f"fanotify cannot name who made an entry here: {FANOTIFY}")
def test_the_entries_a_process_tree_makes_are_told_from_a_neighbours_made_at_the_same_time(tmp_path: Path) -> None:
    name = f"ec-test-{uuid.uuid4().hex[:8]}"
    directories = ["/tmp", str(tmp_path)]
    engine, neighbour = (subprocess.Popen([sys.executable, "-c", TREE, name, role, *directories],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                         for role in ("engine", "neighbour"))
    try:
        watch = EntryWatch(directories, root=engine.pid)
        for tree in (engine, neighbour):
            assert tree.stdin is not None
            tree.stdin.write("go\n")
            tree.stdin.flush()
        for tree in (engine, neighbour):
            assert tree.stdout is not None and tree.stdout.readline() == "done\n"
        made = watch.stop()
    finally:
        for tree in (engine, neighbour):
            tree.communicate(timeout=30)
        for directory in directories:
            _remove(f"{directory}/{name}-*")
    assert sorted(made.ours) == sorted(f"{d}/{name}-{entry}" for d in directories
                                       for entry in ("child-file", "engine-file", "engine-dir"))
    assert made.unattributed == {}  # the neighbour still ran when its entries were looked up: not ours, and known
    assert (made.watched, made.not_watched) == (tuple(directories), {})


@pytest.mark.skipif(FANOTIFY is not None, reason=f"fanotify cannot name who made an entry here: {FANOTIFY}")
def test_an_entry_whose_maker_is_gone_is_ours_only_when_its_pid_was_known_to_be(tmp_path: Path) -> None:
    """A maker that exited before its event was read cannot be looked up: it is unattributed (never a leftover),
    unless its pid is one the caller knows was the tree's (an engine's worker)."""
    engine = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        watch = EntryWatch([str(tmp_path)], root=engine.pid)
        known, other = (subprocess.Popen(["touch", str(tmp_path / name)]) for name in ("known", "other"))
        assert known.wait(30) == other.wait(30) == 0
        made = watch.stop(also_ours=[known.pid])
    finally:
        engine.communicate(timeout=30)
    assert made.ours == (str(tmp_path / "known"),)
    assert set(made.unattributed) <= {str(tmp_path / "other")}  # unattributed if it exited before it was looked up


# Where fanotify cannot name who made an entry: a user namespace of its own (its uid_map is not the initial one).
UNPRIVILEGED = """
import ctypes, json, os, sys
if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:  # CLONE_NEWUSER
    print(json.dumps({"unshare": os.strerror(ctypes.get_errno())}))
    sys.exit()
from pytest_enginecheck.entry_watch import EntryWatch
watch = EntryWatch([sys.argv[1]])
open(os.path.join(sys.argv[1], "made-unwatched"), "w").close()
made = watch.stop()
print(json.dumps({"ours": made.ours, "summary": made.summary()}))
"""


def test_where_fanotify_cannot_name_the_maker_the_detail_says_not_watched_and_why(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", UNPRIVILEGED, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    if "unshare" in found:
        pytest.skip(f"no user namespace can be made here: {found['unshare']}")
    assert found["ours"] == []  # never a silent "clean": it says it did not watch
    assert found["summary"]["watched"] == []
    (reason,) = found["summary"]["not_watched"].values()
    assert reason.startswith("not watched, because fanotify names the process that made an entry only to a process "
                             "with CAP_SYS_ADMIN"), reason
