"""The fixtures model authors use (no_cuda, isolated, multirank, engine) and the markers, seen from a
user's test run: one subprocess pytest run over a file of small tests, then each test's verdict and
failure text, and that nothing it started outlived it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import alive

USER_TESTS = '''
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

PIDS = Path(__file__).parent / "pids"  # the outer test checks these processes are gone


# -- no_cuda ------------------------------------------------------------------------------------

def test_no_cuda_touch(no_cuda):
    torch.zeros(2, device="cuda")


def test_no_cuda_swallowed(no_cuda):
    try:
        torch.cuda.current_device()
    except Exception:
        pass  # the code under test falls back to CPU


def test_no_cuda_clean(no_cuda):
    assert torch.device("cuda").type == "cuda"
    assert torch.ones(2).sum().item() == 2.0
    assert no_cuda.accesses == []


# -- isolated -----------------------------------------------------------------------------------

def square_and_pid(x):
    return x * x, os.getpid()


def test_isolated_returns(isolated):
    value, pid = isolated(square_and_pid, 7)
    assert (value, pid != os.getpid()) == (49, True)
    assert isolated(lambda a, b=1: a + b, 2, b=40) == 42


class ShardingError(Exception):
    pass


def load_shard():
    raise ShardingError("rank 1 got rows 0:8 of q_proj")


def test_isolated_raises(isolated):
    isolated(load_shard)


def crash():
    os.kill(os.getpid(), signal.SIGSEGV)


def test_isolated_crash(isolated):
    isolated(crash)


def sleepy(pid_file):
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(600)


def test_isolated_timeout(isolated):
    isolated(sleepy, str(PIDS / "isolated"), timeout=5)


# -- multirank ----------------------------------------------------------------------------------

def all_reduce_rank(rank, world_size):
    import torch.distributed as dist
    from engine_ref.distributed.parallel_state import get_tp_group

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world_size, get_tp_group().world_size, t.item()


def test_multirank_all_reduce(multirank):
    assert multirank(all_reduce_rank) == [(0, 2, 2, 3.0), (1, 2, 2, 3.0)]


@pytest.mark.world_size(3)
def test_multirank_world_size_marker(multirank):
    assert multirank(all_reduce_rank) == [(r, 3, 3, 6.0) for r in range(3)]


def rank_one_fails(rank, world_size):
    if rank == 1:
        raise ValueError(f"rank {rank} of {world_size} loaded the wrong shard")
    return rank


@pytest.mark.world_size(0)
def test_multirank_world_size_zero(multirank):
    multirank(all_reduce_rank)


@pytest.mark.world_size(3)
def test_world_size_without_multirank():
    pass


def test_multirank_failing_rank(multirank):
    multirank(rank_one_fails)


def rank_one_hangs(rank, world_size, pid_file):
    if rank == 1:
        Path(pid_file).write_text(str(os.getpid()))
        time.sleep(600)
    return rank


def test_multirank_hanging_rank(multirank):
    multirank(rank_one_hangs, str(PIDS / "multirank"), timeout=8)


# -- engine -------------------------------------------------------------------------------------

def test_engine_tp1_and_tp2(engine):
    outputs = {}
    for tp in (1, 2):
        llm = engine("LlamaForCausalLM", tensor_parallel_size=tp)
        assert llm.startup_report.tensor_parallel_size == tp
        outputs[tp] = llm.generate(prompt_token_ids=[[1, 2, 3, 4], [5, 6]], max_tokens=4, ignore_eos=True)
    (PIDS / "engine").write_text(" ".join(str(w.pid) for w in llm.startup_report.workers))
    assert outputs[1] == outputs[2]
    assert [len(o) for o in outputs[1]] == [4, 4]


@pytest.mark.memory_budget(per_rank="5MiB")
def test_engine_budget_too_small(engine):
    engine("LlamaForCausalLM")


@pytest.mark.memory_budget(per_rank="64MiB")
def test_engine_budget_fits_at_tp2(engine):
    llm = engine("LlamaForCausalLM", tensor_parallel_size=2)
    assert [w.rank for w in llm.startup_report.workers] == [0, 1]


@pytest.mark.memory_budget(per_rank="1MiB")
def test_memory_budget_without_engine():
    pass


@pytest.fixture
def stray():
    procs = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def test_engine_leftover_process(stray, engine):
    stray.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    (PIDS / "stray").write_text(str(stray[0].pid))
'''


def sections(output: str) -> dict[str, str]:
    """The FAILURES / ERRORS sections of a pytest run, by title ("test_x", "ERROR at teardown of test_x")."""
    found: dict[str, str] = {}
    title = None
    for line in output.splitlines():
        match = re.fullmatch(r"_{3,} (.+?) _{3,}", line)
        if match:
            title = match.group(1)
            found[title] = ""
        elif re.fullmatch(r"={3,}.*={3,}", line):
            title = None
        elif title is not None:
            found[title] += line + "\n"
    return found


@pytest.fixture
def user_run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
             short_tmp: Path) -> tuple[pytest.RunResult, dict[str, str], Path]:
    """Run USER_TESTS once (with --strict-markers) and return the result, its sections, and the pid dir."""
    # A temp dir of its own: the engine fixture's leak check lists the temp dir, and other jobs on
    # this machine write to the shared one. A short one: the forkserver's socket lives under it.
    monkeypatch.setenv("TMPDIR", str(short_tmp))
    pytester.makeini("[pytest]\npythonpath = .\n")
    pytester.makepyfile(test_fx=USER_TESTS)
    pids = pytester.path / "pids"
    pids.mkdir()
    result = pytester.runpytest_subprocess("-v", "--strict-markers", "-p", "no:cacheprovider", timeout=420)
    return result, sections(result.stdout.str()), pids


def test_fixtures_in_a_user_test_run(user_run: tuple[pytest.RunResult, dict[str, str], Path]) -> None:
    result, failures, pids = user_run
    verdicts = {
        "test_no_cuda_touch": "FAILED", "test_no_cuda_swallowed": "PASSED", "test_no_cuda_clean": "PASSED",
        "test_isolated_returns": "PASSED", "test_isolated_raises": "FAILED", "test_isolated_crash": "FAILED",
        "test_isolated_timeout": "FAILED",
        "test_multirank_all_reduce": "PASSED", "test_multirank_world_size_marker": "PASSED",
        "test_multirank_world_size_zero": "ERROR", "test_world_size_without_multirank": "PASSED",
        "test_memory_budget_without_engine": "PASSED",
        "test_multirank_failing_rank": "FAILED", "test_multirank_hanging_rank": "FAILED",
        "test_engine_tp1_and_tp2": "PASSED", "test_engine_budget_too_small": "FAILED",
        "test_engine_budget_fits_at_tp2": "PASSED", "test_engine_leftover_process": "PASSED",
    }
    for name, verdict in verdicts.items():
        result.stdout.fnmatch_lines([f"test_fx.py::{name} {verdict}*"])
    # --strict-markers accepted world_size and memory_budget: everything was collected and ran.
    result.assert_outcomes(passed=10, failed=7, errors=3, warnings=2)

    # a marker on a test without the fixture it configures: a warning at collection, naming both
    result.stdout.fnmatch_lines([
        "*PytestWarning: @pytest.mark.world_size does nothing on test_world_size_without_multirank: it configures "
        "the 'multirank' fixture, which this test does not use. Request 'multirank', or remove the marker.",
        "*PytestWarning: @pytest.mark.memory_budget does nothing on test_memory_budget_without_engine: it configures "
        "the 'engine' fixture, which this test does not use. Request 'engine', or remove the marker.",
    ], consecutive=False)
    # world_size(0) does not run the default 2 ranks: the test errors, saying what to give
    assert failures["ERROR at setup of test_multirank_world_size_zero"].strip() == (
        "@pytest.mark.world_size(0) on test_multirank_world_size_zero: give a positive number of ranks, e.g. "
        "@pytest.mark.world_size(2)")

    # no_cuda: the API and the line in the test, as the test's own failure...
    touch = failures["test_no_cuda_touch"]
    assert "CudaAccessError: CUDA touched while the enginecheck CUDA guard is on: initialized CUDA: " \
           "torch.zeros at " in touch
    assert re.search(r"test_fx\.py:\d+ \(`torch\.zeros\(2, device=\"cuda\"\)`\)", touch), touch
    # ...or, when the code swallowed the error, at teardown: the test passed but touched CUDA.
    result.stdout.fnmatch_lines(["test_fx.py::test_no_cuda_swallowed ERROR*"])
    swallowed = failures["ERROR at teardown of test_no_cuda_swallowed"]
    assert "The test passed, but its code initialized CUDA: torch.cuda.current_device at " in swallowed
    assert "functools.cache" in swallowed  # the fix hint
    assert not any("test_no_cuda_clean" in title for title in failures)

    # isolated: the child's exception as itself, with the child's traceback as the cause.
    raised = failures["test_isolated_raises"]
    assert re.search(r"^E +test_fx\.ShardingError: rank 1 got rows 0:8 of q_proj$", raised, re.M), raised
    assert re.search(r"engine_ref\.isolation(\.\w+)?\.RemoteTraceback: Traceback \(most recent call last\):", raised), \
        raised
    assert re.search(r'File ".*test_fx\.py", line \d+, in load_shard', raised), raised
    assert "The above exception was the direct cause of the following exception:" in raised
    crash = failures["test_isolated_crash"]
    assert re.search(r"ProcessCrashedError: \S*crash was killed by SIGSEGV before returning a result", crash), crash
    timed_out = failures["test_isolated_timeout"]
    assert re.search(r"ProcessTimeoutError: \S*sleepy did not finish within 5 s and was killed", timed_out), \
        timed_out
    assert re.search(r'File ".*test_fx\.py", line \d+ in sleepy', timed_out), timed_out  # its stack

    # multirank: the failing rank's own traceback; a hang dumped, then killed.
    failing = failures["test_multirank_failing_rank"]
    assert "MultirankError: rank 1 of 2 failed:" in failing
    assert re.search(r'File ".*test_fx\.py", line \d+, in rank_one_fails', failing), failing
    assert "ValueError: rank 1 of 2 loaded the wrong shard" in failing
    hanging = failures["test_multirank_hanging_rank"]
    assert "MultirankError: rank(s) [1] of 2 did not finish within 8 s and were killed." in hanging
    assert "--- rank 1 ---" in hanging
    assert re.search(r'File ".*test_fx\.py", line \d+ in rank_one_hangs', hanging), hanging

    # engine: a budget too small says what each part needs.
    budget = failures["test_engine_budget_too_small"]
    assert re.search(r"memory_budget\(per_rank='5MiB'\): rank 0 needs [\d.]+ [KMG]iB \(weights [\d.]+ [KMG]iB, "
                     r"activations [\d.]+ [KMG]iB, KV [\d.]+ [KMG]iB for one request of max_model_len[^)]*\) "
                     r"but the budget is 5\.00 MiB", budget), budget
    # the engine fixture's teardown names what a test left running
    result.stdout.fnmatch_lines(["test_fx.py::test_engine_leftover_process ERROR*"])
    leftover = failures["ERROR at teardown of test_engine_leftover_process"]
    stray_pid = int((pids / "stray").read_text())
    assert f"the engine(s) this test started left behind: child processes [{stray_pid}]" in leftover

    # Nothing the fixtures started outlived the run: the hung child, the hung rank, the TP=2 workers.
    started = {name: [int(pid) for pid in (pids / name).read_text().split()]
               for name in ("isolated", "multirank", "engine")}
    assert len(started["engine"]) == 2  # the TP=2 engine's worker processes
    assert {name: [pid for pid in found if alive(pid)] for name, found in started.items()} == \
           {"isolated": [], "multirank": [], "engine": []}
