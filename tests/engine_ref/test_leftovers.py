"""Nothing of ours stays in the temp dir after a kill: each owner's entries live in one directory named for it
(engine_ref.isolation.tempdirs), and the next start sweeps those whose owner is gone.

Real processes, real signals, each with a private TMPDIR: an engine parent killed before and after READY
(SIGKILL and SIGTERM), a pytest --enginecheck run killed while it checks, then one more start.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from engine_ref.isolation.tempdirs import PREFIX, owner_dir, start_time, sweep
from tests import fault_models
from tests.fault_models import fault_overrides
from tests.helpers import SMALL_ENGINE

REPO = Path(__file__).parents[2]
OURS = (PREFIX, "enginecheck-", "pymp-")  # every name we make at the top of a temp dir, old layouts included

ENGINE_SCRIPT = """
import sys, time
sys.path.insert(0, {repo!r})
from engine_ref import LLM
from tests import fault_models
from tests.helpers import SMALL_ENGINE

with fault_models.registered():
    print("starting", flush=True)
    llm = LLM(sys.argv[1], tensor_parallel_size=2, ready_timeout_s=120, **{engine!r})
    print("ready", flush=True)
    if sys.argv[2] == "hold":
        time.sleep(120)
    llm.shutdown()
"""


def ours(tmp: Path) -> list[str]:
    return sorted(name for name in os.listdir(tmp) if name.startswith(OURS))


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)


def descendants(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def all_gone(pids: list[int]) -> bool:
    return not [pid for pid in pids if _running(pid)]


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that is not a zombie (one that exits while it is asked about is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def tmp() -> Iterator[Path]:
    """A short private TMPDIR (the forkserver's socket path under it must fit AF_UNIX's 108 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="er-left-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def popen(args: list[str], tmp: Path, procs: list[subprocess.Popen[str]], cwd: Path | None = None
          ) -> subprocess.Popen[str]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=cwd, env={**os.environ, "TMPDIR": str(tmp)})
    procs.append(proc)
    return proc


def read_line(proc: subprocess.Popen[str], expected: str, timeout: float) -> None:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != expected:
        proc.kill()
        pytest.fail(f"expected {expected!r}, got {line!r}: {proc.communicate()[1][-3000:]}")


@pytest.fixture
def engine_script(tmp: Path) -> Iterator[Path]:
    script = tmp.parent / f"{tmp.name}-engine.py"
    script.write_text(ENGINE_SCRIPT.format(repo=str(REPO), engine=SMALL_ENGINE))
    yield script
    script.unlink()


def kill(proc: subprocess.Popen[str], sig: signal.Signals) -> list[int]:
    """Send ``sig`` to the owner alone, as a user or a CI runner would; wait for it and everything it started."""
    children = descendants(proc.pid)
    os.kill(proc.pid, sig)
    proc.wait(10)
    wait_until(lambda: all_gone(children), 10, "the killed process's children exiting (the death pipe)")
    return children


def one_more_start(engine_script: Path, model: Path, tmp: Path, procs: list[subprocess.Popen[str]]) -> None:
    proc = popen([sys.executable, str(engine_script), str(model), "exit"], tmp, procs)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]


# Every (when, signal) pair, killed one after the other in one temp dir: each case's start is the previous case's
# next start (it must sweep what the killed one left), and one last start sweeps the last case's.
KILLS = [(when, sig) for when in ("before READY", "after READY") for sig in (signal.SIGKILL, signal.SIGTERM)]


def test_an_engine_parent_killed_leaves_nothing_after_the_next_start(
        tiny_checkpoint: Callable[..., Path], engine_script: Path, tmp: Path,
        procs: list[subprocess.Popen[str]]) -> None:
    with fault_models.registered() as arch:
        hangs = tiny_checkpoint(arch, overrides=fault_overrides("hang", "init"))  # rank 1 never gets READY
    llama = tiny_checkpoint("LlamaForCausalLM")
    for when, sig in KILLS:
        case = f"killed by {sig.name} {when}"
        proc = popen([sys.executable, str(engine_script), str(hangs if when == "before READY" else llama), "hold"],
                     tmp, procs)
        read_line(proc, "starting", timeout=60)
        if when == "before READY":
            store = f"{PREFIX}{proc.pid}-*/mp-*/store"
            wait_until(lambda pattern=store: bool(list(tmp.glob(pattern))), 60, "the rendezvous store")
        else:
            read_line(proc, "ready", timeout=60)
        kill(proc, sig)
        left = ours(tmp)  # this owner's directory alone: its start swept the previous case's
        assert [name.split("-")[:2] for name in left] == [["engine_ref", str(proc.pid)]], (case, left)
        assert list((tmp / left[0]).glob("pymp-*")), f"{case}: multiprocessing's directory is inside the owner's"
        assert bool(list((tmp / left[0]).glob("mp-*/store"))) == (when == "before READY"), case
    one_more_start(engine_script, llama, tmp, procs)
    assert ours(tmp) == []


def test_a_killed_pytest_run_leaves_nothing_after_the_next_start(
        tiny_checkpoint: Callable[..., Path], engine_script: Path, tmp: Path,
        procs: list[subprocess.Popen[str]]) -> None:
    project = tmp.parent / f"{tmp.name}-project"  # no tests of its own: the run holds only the engine checks
    project.mkdir()
    try:
        proc = popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--enginecheck",
                      "--enginecheck-checks=load", "-k", "LlamaForCausalLM", str(project)], tmp, procs, cwd=project)
        # The session's tiny checkpoint is written: the run is checking.
        wait_until(lambda: list(tmp.glob(f"{PREFIX}{proc.pid}-*/enginecheck-*/*")), 120, "the session's checkpoint")
        kill(proc, signal.SIGKILL)
        left = ours(tmp)
        # The session's own dir, and those of its check children (each check runs in a private TMPDIR).
        assert {tuple(name.split("-")[:2]) for name in left} == {("engine_ref", str(proc.pid))}, left
        owned = [tmp / name for name in left if list((tmp / name).glob("enginecheck-*"))]
        assert len(owned) == 1 and list(owned[0].glob("pymp-*")), left
        one_more_start(engine_script, tiny_checkpoint("LlamaForCausalLM"), tmp, procs)
        assert ours(tmp) == []
    finally:
        shutil.rmtree(project, ignore_errors=True)


def test_the_sweep_removes_only_our_directories_of_owners_that_are_gone(tmp: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = start_time(sleeper.pid)
        assert started
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        entries = {
            "live": f"{PREFIX}{sleeper.pid}-{started}-aaaaaaaa",  # its owner runs: kept
            "reused": f"{PREFIX}{sleeper.pid}-{started + 1}-bbbbbbbb",  # the pid now belongs to another process
            "dead": f"{PREFIX}{dead.pid}-{started}-cccccccc",
            "ray": f"{PREFIX}{dead.pid}-{started}-ray-dddddddd",
            "other prefix": f"pymp-{dead.pid}-{started}-eeeeeeee",  # not ours to judge
            "old layout": f"{PREFIX}mp-ffffffff",  # no owner in the name: kept
        }
        for name in entries.values():
            (tmp / name).mkdir()
            (tmp / name / "inside").write_text("x")
        as_file = tmp / f"{PREFIX}{dead.pid}-{started}-file"
        as_file.write_text("not a directory")
        target = tmp / "target"
        target.mkdir()
        (tmp / f"{PREFIX}{dead.pid}-{started}-link").symlink_to(target, target_is_directory=True)
        removed = sweep(str(tmp))
        assert sorted(Path(p).name for p in removed) == sorted([entries["reused"], entries["dead"], entries["ray"]])
        kept = {entries["live"], entries["other prefix"], entries["old layout"], as_file.name, "target",
                f"{PREFIX}{dead.pid}-{started}-link"}
        assert set(os.listdir(tmp)) == kept
        assert (target / ".").exists()
        # This process's own directory: made once per temp dir, with its pid and start time, never swept by itself.
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        mine = owner_dir()
        assert Path(mine).parent == tmp
        assert Path(mine).name.startswith(f"{PREFIX}{os.getpid()}-{start_time(os.getpid())}-")
        assert owner_dir() == mine and mine not in sweep(str(tmp))
        shutil.rmtree(mine)
    finally:
        sleeper.kill()
        sleeper.wait()
