"""engine_ref.isolation on real forks: values, exceptions, crashes, exit codes, timeouts, output.

Every child here is a real fork of the warm forkserver (or, for nested children, of its caller).
"""

from __future__ import annotations

import json
import multiprocessing.spawn
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import psutil
import pytest

from engine_ref.isolation import (
    AnswerWait,
    Deadline,
    ProcessCrashedError,
    ProcessTimeoutError,
    RemoteError,
    RemoteTraceback,
    get_mp_context,
    run_isolated,
    start_process,
)

TIMEOUT = 2.0  # for the timeout tests
# How long the hanging child sleeps, and the silent child waits to answer: the upper bounds of the timeout tests,
# what would end the wait if the timeout did not (never this machine's speed).
HANG_S = 60.0
SILENT_S = 30.0


def add(a: int, b: int = 0) -> tuple[int, int]:
    return a + b, os.getpid()


class CustomError(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"custom failure {code}")
        self.code = code


def raise_custom() -> None:
    raise CustomError(7)


class Unpicklable(Exception):
    def __reduce__(self) -> tuple:
        raise TypeError("no pickling here")


def raise_unpicklable() -> None:
    raise Unpicklable("it stays in the child")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_returns_the_value_computed_in_another_process() -> None:
    assert run_isolated(add, 2, b=3)[0] == 5
    assert run_isolated(add, 1)[1] != os.getpid()
    scale = 10
    assert run_isolated(lambda x: x * scale, 4) == 40, "closures travel by cloudpickle"


def test_an_exception_is_reraised_as_itself_with_the_remote_traceback() -> None:
    with pytest.raises(CustomError, match="custom failure 7") as info:
        run_isolated(raise_custom)
    assert info.value.code == 7
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "in raise_custom" in cause.text and "test_isolation.py" in cause.text


def test_an_exception_that_does_not_pickle_arrives_as_its_text() -> None:
    with pytest.raises(RemoteError, match="Unpicklable: it stays in the child") as info:
        run_isolated(raise_unpicklable)
    assert info.value.type_name == "Unpicklable" and "in raise_unpicklable" in info.value.remote_traceback


def test_a_value_that_does_not_pickle_is_a_clear_error() -> None:
    with pytest.raises(RemoteError, match="the return value of type generator cannot be pickled"):
        run_isolated(lambda: (i for i in range(3)))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
def test_a_crash_by_signal_names_the_signal_and_keeps_the_output(sig: signal.Signals) -> None:
    def crash() -> None:
        print("about to die", flush=True)
        os.kill(os.getpid(), sig)

    with pytest.raises(ProcessCrashedError) as info:
        run_isolated(crash, name="crasher")
    error = info.value
    assert error.exitcode == -sig and error.signal_name == sig.name
    assert str(error).startswith(f"crasher was killed by {sig.name} before returning a result.")
    assert "about to die" in error.output and "about to die" in str(error)


@pytest.mark.parametrize(("exit", "code"), [(lambda: sys.exit(3), 3), (lambda: os._exit(5), 5)])
def test_an_exit_is_an_exit_code(exit: object, code: int) -> None:
    with pytest.raises(ProcessCrashedError, match=f"exited with code {code} before returning a result") as info:
        run_isolated(exit)
    assert info.value.exitcode == code and info.value.signal_name is None


def hang_with_a_grandchild() -> None:
    sleeper = subprocess.Popen(["sleep", str(HANG_S)])
    print(f"hanging now, grandchild {sleeper.pid}", flush=True)
    time.sleep(HANG_S)


def test_a_timeout_dumps_the_stacks_and_kills_the_whole_tree() -> None:
    start = time.monotonic()
    with pytest.raises(ProcessTimeoutError) as info:
        run_isolated(hang_with_a_grandchild, timeout=TIMEOUT)
    elapsed = time.monotonic() - start
    error = info.value
    grandchild = int(error.output.split("grandchild ")[1].split()[0])
    assert TIMEOUT <= elapsed < HANG_S, "the timeout ended the call, not the child's own end"
    assert str(error).startswith(f"hang_with_a_grandchild did not finish within {TIMEOUT:g} s and was killed.")
    assert "in hang_with_a_grandchild" in error.stacks and "test_isolation.py" in error.stacks
    assert error.stacks in str(error)
    assert "hanging now" in error.output
    assert gone(grandchild), "a process the child started outlived the call"


def test_output_from_python_and_from_file_descriptors_reaches_the_callers_stderr(
        capfd: pytest.CaptureFixture[str]) -> None:
    def noisy() -> int:
        print("to stdout")
        print("to stderr", file=sys.stderr)
        os.write(1, b"raw fd 1\n")
        return 1

    assert run_isolated(noisy) == 1
    out, err = capfd.readouterr()
    assert out == ""
    assert "to stdout" in err and "to stderr" in err and "raw fd 1" in err


def test_a_nested_child_forks_from_its_caller_into_the_same_process_group() -> None:
    def outer() -> tuple[int, int, int, int]:
        inner_ppid, inner_group = run_isolated(lambda: (os.getppid(), os.getpgrp()))
        return os.getpid(), os.getpgrp(), inner_ppid, inner_group

    pid, group, inner_parent, inner_group = run_isolated(outer)
    assert group == pid != os.getpgrp(), "an isolated child leads its own group"
    assert inner_parent == pid and inner_group == group


def test_the_preparation_hook_is_installed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """get_mp_context() leaves multiprocessing's get_preparation_data as it finds it."""
    def wrapper(name: str) -> dict:
        return {}

    monkeypatch.setattr(multiprocessing.spawn, "get_preparation_data", wrapper)
    get_mp_context()
    assert multiprocessing.spawn.get_preparation_data is wrapper


def answer_after(conn: Connection, delay_s: float, answer: bool) -> None:
    time.sleep(delay_s)
    if answer:
        conn.send_bytes(pickle.dumps(os.getpid()))


def test_answer_wait_yields_answers_and_deaths_and_leaves_the_silent_pending() -> None:
    """One child answers, one exits without a word, one is still silent at the deadline.

    The first two have ended before the silent one starts and the deadline with it (each answered or exited by then,
    whatever the machine's load: the wait must yield both, the answer rather than its child's death), so only the
    silent child is left to the deadline."""
    ctx = get_mp_context()
    plans = {"answers": (0.0, True), "exits": (0.0, False), "silent": (SILENT_S, True)}
    conns, procs = {}, {}
    try:
        for key, (delay_s, answer) in plans.items():
            if key == "silent":
                for ended in ("answers", "exits"):
                    procs[ended].join(HANG_S)
                    assert procs[ended].exitcode == 0, ended
            conns[key], writer = ctx.Pipe(duplex=False)
            procs[key] = start_process(answer_after, writer, delay_s, answer, ctx=ctx)
            writer.close()
        deadline = Deadline(TIMEOUT)
        wait = AnswerWait(conns, {key: proc.sentinel for key, proc in procs.items()}, deadline)
        start = time.monotonic()
        events = dict(wait)
        elapsed = time.monotonic() - start
        assert pickle.loads(events["answers"]) == procs["answers"].pid
        assert events["exits"] is None
        assert list(wait.pending) == ["silent"] and deadline.expired()
        assert TIMEOUT * 0.9 <= elapsed < SILENT_S, "the deadline ended the wait, not the silent child's answer"
    finally:
        for key in procs:
            conns[key].close()
            procs[key].close()


def test_a_deadline_can_be_shortened_but_not_extended() -> None:
    deadline = Deadline(None)
    assert deadline.remaining() is None and not deadline.expired()
    deadline.shorten(TIMEOUT)
    remaining = deadline.remaining()
    assert remaining is not None and 0 < remaining <= TIMEOUT
    deadline.shorten(10 * TIMEOUT)
    assert deadline.remaining() <= TIMEOUT  # type: ignore[operator]
    deadline.shorten(0)
    assert deadline.expired() and deadline.remaining() == 0.0


def test_the_inspect_check_of_a_hanging_import_shows_the_inspection_childs_stacks(pytester: pytest.Pytester) -> None:
    """The model hangs in the registry's inspection child, two processes below pytest: its hung line is reported,
    not the check child's wait for it."""
    zoo = Path(__file__).parents[1] / "plugin_zoo"
    shutil.copytree(zoo, pytester.path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    pytester.makeini("[pytest]\npythonpath = .\n")
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", "--enginecheck-target=zoo:MODELS",
                                           "--enginecheck-checks=inspect", "--enginecheck-timeout=4",
                                           f"--enginecheck-json={report}", "-k", "HangsModel", timeout=120)
    result.assert_outcomes(failed=1)
    [hung] = json.loads(report.read_text())["results"]
    assert hung["message"].startswith(
        "Inspecting HangsModel did not finish within 4 s (--enginecheck-timeout): the registry's inspection child "
        "was killed after 3.2 s. Its Python stacks at that moment:\n")
    line = next(i for i, text in enumerate((zoo / "zoo" / "hangs.py").read_text().splitlines(), 1) if "sleep" in text)
    stacks = hung["detail"]["stacks"]
    assert (hung["detail"]["kind"], hung["detail"]["timeout_s"]) == ("timeout", 4)
    # The innermost frame is the model's hung line (the parent's would be its wait in connection.wait).
    innermost = stacks.split("(most recent call first):\n", 1)[1].splitlines()[0]
    assert innermost.endswith(f'hangs.py", line {line} in wait_for_device'), stacks
    assert "in _inspect_in_subprocess" in stacks and "in wait\n" not in stacks
    result.stdout.fnmatch_lines([f'*hangs.py", line {line} in wait_for_device'])
