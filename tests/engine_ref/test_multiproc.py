"""The multiprocess executor on real processes and real gloo: startup, faults, shutdown, leaks.

Every engine here is a TP=2 (or 4) engine whose ranks are WorkerProcs forked from the warm
forkserver. Faults come from ``tests.fault_models``: a Llama that raises, hangs or dies on rank 1.
Every wait is bounded; the fault tests assert how fast the failure surfaced.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from engine_ref import LLM
from engine_ref.config import ParallelConfig
from engine_ref.config.parallel import DEFAULT_READY_TIMEOUT_S, DEFAULT_RPC_TIMEOUT_S
from engine_ref.entrypoints.cli import main as cli_main
from engine_ref.errors import ConfigError, EngineDeadError, WorkerStartupError
from engine_ref.executor.multiproc import MultiprocExecutor, WorkerError
from engine_ref.executor.protocol import RpcTimeoutError
from engine_ref.isolation import RemoteTraceback, get_mp_context, run_isolated
from engine_ref.isolation.tempdirs import owner_dir
from engine_ref.model_executor.model_loader.checkpoint import example_config
from pytest_enginecheck.leaks import ForeignShmWatch, temp_entries, unowned_shm_entries
from tests import fault_models
from tests.fault_models import fault_overrides
from tests.helpers import LLAMA, SMALL_ENGINE, wait_gone

PROMPTS = [[1, 5, 9, 13, 17], [7, 3]]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def reference_tokens(tiny_checkpoint: Callable[..., Path]) -> list[list[int]]:
    """TP=1 greedy tokens of the tiny Llama (TP=1 itself is compared to transformers elsewhere)."""
    with LLM(str(tiny_checkpoint(LLAMA)), **SMALL_ENGINE) as llm:
        return llm.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture
def faulty(tiny_checkpoint: Callable[..., Path]) -> Iterator[Callable[..., Path]]:
    """``faulty(kind, phase)``: a checkpoint whose rank 1 fails with ``kind`` in ``phase``."""
    with fault_models.registered() as arch:
        yield lambda kind, phase: tiny_checkpoint(arch, overrides=fault_overrides(kind, phase))


def executor_of(llm: LLM) -> MultiprocExecutor:
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor)
    return executor


def start_failing(model: Path, **kwargs: Any) -> tuple[WorkerStartupError, float]:
    """Start an engine that must fail; return its error and how long failing took."""
    start = time.monotonic()
    with pytest.raises(WorkerStartupError) as info:
        LLM(str(model), tensor_parallel_size=2, **SMALL_ENGINE, **kwargs)
    return info.value, time.monotonic() - start


# -- startup -----------------------------------------------------------------------------------------


def test_tp2_startup_report_per_rank(llama: Path, reference_tokens: list[list[int]]) -> None:
    with LLM(str(llama), tensor_parallel_size=2, **SMALL_ENGINE) as llm:
        report = llm.startup_report
        assert llm.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True) == reference_tokens
        pids = [w.pid for w in report.workers]
    assert report.executor_backend == "mp" and [w.rank for w in report.workers] == [0, 1]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for worker in report.workers:
        assert set(worker.phases) >= {"init_device", "load_model", "profile_run", "initialize_cache"}
        assert worker.bytes_read > 0
        memory = worker.memory
        assert memory.weights > 0 and memory.activation_peak > 0 and memory.kv_cache > 0
        assert memory.total <= memory.capacity
    # The KV cache was sized once (from the smallest rank) and allocated on every rank.
    assert len({w.memory.kv_cache for w in report.workers}) == 1
    assert report.num_gpu_blocks > 0
    assert not wait_gone(pids, timeout=0.5), "shutdown must reap the workers before it returns"
    assert executor_of(llm).exit_statuses == {0: "exited with code 0", 1: "exited with code 0"}, "a polite exit"


def test_workers_are_forks_of_the_warm_forkserver(llama: Path) -> None:
    """Workers are not forks of this process (which may hold CUDA): their parent is the forkserver."""
    with LLM(str(llama), tensor_parallel_size=2, **SMALL_ENGINE) as llm:
        parents = {psutil.Process(w.pid).parent() for w in llm.startup_report.workers}
    assert len(parents) == 1
    (parent,) = parents
    assert parent.pid != os.getpid()
    assert "multiprocessing.forkserver" in " ".join(parent.cmdline())
    assert parent.ppid() == os.getpid()


def test_tp4_replicates_kv_heads_and_matches_tp1(llama: Path, reference_tokens: list[list[int]]) -> None:
    with LLM(str(llama), tensor_parallel_size=4, **SMALL_ENGINE) as llm:
        assert llm.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True) == reference_tokens
        assert len({w.pid for w in llm.startup_report.workers}) == 4


def test_spawn_when_this_process_initialized_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked to fork a process that initialized CUDA, engine_ref spawns instead, and says why.

    This CPU machine cannot initialize CUDA, so ``torch.cuda.is_initialized`` is made to say it did;
    the child is real: a fresh interpreter started by this process. (A whole
    engine on spawned workers is measured by benchmarks/startup.py; it takes seconds per worker.)
    """
    monkeypatch.setenv("ENGINE_REF_WORKER_MULTIPROC_METHOD", "fork")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(RuntimeWarning, match="initialized CUDA.*Cannot re-initialize CUDA in forked subprocess"):
        ctx = get_mp_context()
    assert ctx.get_start_method() == "spawn"
    with pytest.warns(RuntimeWarning, match="initialized CUDA"):
        parent = run_isolated(os.getppid, timeout=60)
    with pytest.warns(RuntimeWarning, match="initialized CUDA"):
        cmdline = run_isolated(Path.read_bytes, Path("/proc/self/cmdline"), timeout=60)
    assert parent == os.getpid()
    assert b"multiprocessing.spawn" in cmdline, cmdline


def test_cli_startup_prints_the_per_rank_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["startup", LLAMA, "--tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor_parallel_size=2 executor=mp" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [row[0] for row in rows] == ["0", "1"]
    assert len({row[1] for row in rows}) == 2 and all(row[1].isdigit() for row in rows)  # one pid per rank


# -- collective_rpc ----------------------------------------------------------------------------------


def test_collective_rpc_results_errors_and_timeout(llama: Path) -> None:
    with LLM(str(llama), tensor_parallel_size=2, **SMALL_ENGINE) as llm:
        executor = executor_of(llm)
        assert executor.collective_rpc(lambda worker, k: (worker.rank, os.getpid(), k), args=(7,)) == [
            (0, llm.startup_report.workers[0].pid, 7), (1, llm.startup_report.workers[1].pid, 7)]

        def tp_group(worker: Any) -> tuple[int, int, bool, bool]:  # runs in each rank
            import torch.distributed as dist

            from engine_ref.distributed.parallel_state import get_tp_group

            tp = get_tp_group()
            return tp.rank_in_group, tp.world_size, dist.get_backend(tp.device_group) == "gloo", (
                tp.device_group is not dist.group.WORLD)

        assert executor.collective_rpc(tp_group) == [(0, 2, True, True), (1, 2, True, True)]

        with pytest.raises(WorkerError, match="no_such_method failed on rank 0") as info:
            executor.collective_rpc("no_such_method")
        assert isinstance(info.value.__cause__, RemoteTraceback)
        assert "AttributeError" in info.value.remote_traceback
        assert executor.collective_rpc("report")[1].rank == 1, "a raising call leaves the engine usable"

        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"did not finish on rank 0, 1 within 0.5 s") as timeout:
            executor.collective_rpc(lambda worker: time.sleep(60), timeout=0.5)
        assert time.monotonic() - start < 30, "the call ends at its deadline, not when the 60 s sleep does"
        assert str(timeout.value).count("in <lambda>") == 2, "each rank's stack at the timeout"
        with pytest.raises(EngineDeadError, match="did not finish"):
            llm.generate(PROMPTS, max_tokens=1)


# -- startup failures --------------------------------------------------------------------------------


def test_worker_raising_during_load_fails_startup_with_its_traceback(faulty: Callable[..., Path]) -> None:
    error, seconds = start_failing(faulty("raise", "load_weights"))
    message = str(error)
    assert message.startswith("Worker rank 1 (pid ")
    assert "failed in load_model: tests.fault_models.InjectedFault: injected fault on rank 1 in load_weights" in message
    assert "Traceback of rank 1:" in message and "fault_models.py" in message and "_maybe_fail" in message
    assert isinstance(error.__cause__, RemoteTraceback) and "InjectedFault" in error.__cause__.text
    assert seconds < DEFAULT_READY_TIMEOUT_S, "reported when it happened, not at the ready timeout"


@pytest.mark.parametrize(("kind", "signal_name"), [("sigkill", "SIGKILL"), ("sigsegv", "SIGSEGV")])
def test_worker_dying_during_startup_names_rank_and_signal(faulty: Callable[..., Path], kind: str,
                                                           signal_name: str) -> None:
    error, seconds = start_failing(faulty(kind, "init"))
    assert str(error).startswith("Worker rank 1 (pid ")
    assert f"was killed by {signal_name} during startup, before it was ready" in str(error)
    assert seconds < DEFAULT_READY_TIMEOUT_S, "reported when it happened, not at the ready timeout"


@pytest.mark.parametrize("how", ["config", "env"])
def test_hung_worker_is_dumped_and_killed_at_the_ready_timeout(faulty: Callable[..., Path], how: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Where, at the deadline, rank 0 was not ready yet either or rank 1 had not reached the planted hang (its stacks
    show no ``_maybe_fail``: a loaded machine), the engine is started again with a deadline 4 times as long, and every
    assertion holds for the start that reached it."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    for timeout_s in (2.0, 8.0, 32.0):
        kwargs: dict[str, Any] = {}
        if how == "config":
            kwargs["ready_timeout_s"] = timeout_s
        else:
            monkeypatch.setenv("ENGINE_REF_READY_TIMEOUT_S", str(timeout_s))
        error, seconds = start_failing(faulty("hang", "init"), **kwargs)
        message = str(error)
        if message.startswith("Worker rank 1 was not ready") and "_maybe_fail" in message:
            break
    assert (f"Worker rank 1 was not ready within {timeout_s:g} s (ready_timeout_s / ENGINE_REF_READY_TIMEOUT_S)"
            in message)
    assert "and was killed" in message
    # faulthandler's dump of the hung rank: the sleep in the fault model, under the loader.
    assert "fault_models.py" in message and "_maybe_fail" in message and "load_model" in message
    # the message's seconds are the deadline the wait used; the default did not end it, nor the 3600 s hang
    assert timeout_s <= seconds < DEFAULT_READY_TIMEOUT_S, "it fails at the ready timeout asked for"
    leftover = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before
                and "from multiprocessing." not in " ".join(p.cmdline())]  # the forkserver and its tracker stay
    assert not wait_gone(leftover, timeout=10.0)


def test_a_rank_raising_in_a_collective_kills_the_engine_after_a_grace(faulty: Callable[..., Path],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 raises in forward (the profile run) while rank 0 waits for it in an all-reduce."""
    monkeypatch.setattr(MultiprocExecutor, "rpc_error_grace_s", 1.0)
    timeouts = {"rpc_timeout_s": 120.0, "collective_timeout_s": 120.0}
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"determine_available_memory failed on rank 1: .*InjectedFault") as info:
        LLM(str(faulty("raise", "forward")), tensor_parallel_size=2, **SMALL_ENGINE, **timeouts)
    assert time.monotonic() - start < 120 / 2, "the grace ended it, not the RPC or collective timeout"
    assert info.value.rank == 1 and "_maybe_fail" in info.value.remote_traceback


def test_shutdown_escalates_to_sigterm_then_sigkill(llama: Path) -> None:
    llm = LLM(str(llama), tensor_parallel_size=2, **SMALL_ENGINE)
    executor = executor_of(llm)

    def stall_shutdown(worker: Any) -> None:  # runs in each rank
        if worker.rank == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        worker.shutdown = lambda: time.sleep(60)

    executor.collective_rpc(stall_shutdown)
    executor.shutdown_grace_s = executor.terminate_grace_s = 0.3
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 30, "the escalation ends the 60 s stalls"
    assert executor.exit_statuses == {0: "was killed by SIGKILL", 1: "was killed by SIGTERM"}


# -- a worker dying after startup -----------------------------------------------------------------


NOTICE_DEADLINE_S = 30.0  # a deadline against hanging: nothing but the monitor could notice, however long


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
def test_monitor_notices_a_dead_worker_without_a_call(llama: Path, sig: signal.Signals) -> None:
    """The monitor thread waits on the workers' sentinels, so it marks the engine dead with no call to the workers
    (how fast, in milliseconds, is measured by ``benchmarks/startup.py --deaths``, not asserted on this machine)."""
    with LLM(str(llama), tensor_parallel_size=2, **SMALL_ENGINE) as llm:
        executor = executor_of(llm)
        victim = llm.startup_report.workers[1].pid
        other = llm.startup_report.workers[0].pid
        os.kill(victim, sig)
        killed_at = time.monotonic()
        while executor.dead_reason is None and time.monotonic() - killed_at < NOTICE_DEADLINE_S:
            time.sleep(0.005)
        assert executor.dead_reason is not None, f"the monitor did not notice the dead worker in {NOTICE_DEADLINE_S} s"
        expected = f"Worker rank 1 (pid {victim}) was killed by {sig.name}"
        assert executor.dead_reason.startswith(expected)
        with pytest.raises(EngineDeadError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            llm.generate(PROMPTS, max_tokens=1)
        assert not wait_gone([other], timeout=10.0), "the other rank must be taken down with the engine"


# -- a worker that stops answering (SIGSTOP) ---------------------------------------------------------


@pytest.mark.parametrize("how", ["config", "env"])
def test_a_stopped_worker_fails_generate_within_the_rpc_timeout(llama: Path, how: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 stopped: rank 0 waits for it in an all-reduce, and generate raises at rpc_timeout_s, not never."""
    timeout_s = 2.0
    kwargs: dict[str, Any] = {}
    if how == "config":
        kwargs["rpc_timeout_s"] = timeout_s
    else:
        monkeypatch.setenv("ENGINE_REF_RPC_TIMEOUT_S", str(timeout_s))
    with LLM(str(llama), tensor_parallel_size=2, **SMALL_ENGINE, **kwargs) as llm:
        pids = [w.pid for w in llm.startup_report.workers]
        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RpcTimeoutError) as info:
            llm.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)
        seconds = time.monotonic() - start
        assert timeout_s <= seconds < DEFAULT_RPC_TIMEOUT_S, seconds  # the 2 s asked for, not the default
        assert not wait_gone(pids, timeout=10.0), "the workers are killed with the engine, before any shutdown"
    error = info.value
    assert isinstance(error, EngineDeadError) and isinstance(error, TimeoutError)
    assert (error.method, error.ranks) == ("execute_model", [0, 1])
    assert str(error).startswith("execute_model did not finish on rank 0, 1 within 2 s (rpc_timeout_s / "
                                 "ENGINE_REF_RPC_TIMEOUT_S); the engine is dead and its workers were killed.")
    # Rank 0 waits in the all-reduce; rank 1 stopped where it waited for the call, and was continued to dump.
    assert "in all_reduce" in error.stacks[0] and "in execute_model" in error.stacks[0]
    assert error.stacks[1].startswith("It was stopped (SIGSTOP, or a debugger)")
    assert "in worker_busy_loop" in error.stacks[1]
    assert f"--- rank 1 (pid {pids[1]}) ---\nIt was stopped" in str(error)


def test_the_collective_timeout_is_its_own_setting(llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short collective timeout (not the ready timeout) ends rank 0's wait; the stopped rank is blamed."""
    monkeypatch.setattr(MultiprocExecutor, "rpc_error_grace_s", 1.0)
    with LLM(str(llama), tensor_parallel_size=2, collective_timeout_s=1.5, ready_timeout_s=120, **SMALL_ENGINE) as llm:
        pids = [w.pid for w in llm.startup_report.workers]
        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RpcTimeoutError) as info:
            llm.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)
        seconds = time.monotonic() - start
    # the collective timeout, then the grace for the stuck rank; not the ready timeout, nor the RPC timeout
    assert 1.5 + 1.0 <= seconds < 120, seconds
    assert info.value.ranks == [1]
    assert str(info.value).startswith("execute_model did not finish on rank 1 within 1 s after rank 0 raised; ")
    assert ("Rank 0 raised meanwhile: execute_model failed on rank 0: engine_ref.distributed.parallel_state."
            "CollectiveTimeoutError: all_reduce over the TP group timed out on rank 0 after 1.5 s "
            "(collective_timeout_s / ENGINE_REF_COLLECTIVE_TIMEOUT_S)") in str(info.value)
    assert not wait_gone(pids, timeout=10.0)


@pytest.mark.parametrize("variable", ["ENGINE_REF_RPC_TIMEOUT_S", "ENGINE_REF_COLLECTIVE_TIMEOUT_S"])
@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "nan"])
def test_timeout_variables_refuse_what_is_not_a_finite_positive_number(variable: str, value: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=f"^{variable}={value!r} is not a number of seconds"):
        ParallelConfig(tensor_parallel_size=2)


@pytest.mark.parametrize("field", ["rpc_timeout_s", "collective_timeout_s"])
def test_timeout_fields_take_the_environment_and_refuse_bad_values(field: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert getattr(ParallelConfig(tensor_parallel_size=2), field) == 300.0
    monkeypatch.setenv(f"ENGINE_REF_{field.upper()}", "7.5")
    assert getattr(ParallelConfig(tensor_parallel_size=2), field) == 7.5
    assert getattr(ParallelConfig(tensor_parallel_size=2, **{field: 3}), field) == 3.0, "the field wins"
    for bad in (0, -2.0, float("inf"), "5", True):
        with pytest.raises(ConfigError, match=f"^{field}={bad!r} must be a finite positive number of seconds"):
            ParallelConfig(tensor_parallel_size=2, **{field: bad})


# -- isolation between engines -----------------------------------------------------------------------


def test_two_engines_in_one_process_do_not_collide(llama: Path, reference_tokens: list[list[int]]) -> None:
    with (LLM(str(llama), tensor_parallel_size=2, **SMALL_ENGINE) as a,
          LLM(str(llama), tensor_parallel_size=2, **SMALL_ENGINE) as b):
        assert executor_of(a).distributed_init_method != executor_of(b).distributed_init_method
        assert not {w.pid for w in a.startup_report.workers} & {w.pid for w in b.startup_report.workers}
        for _ in range(2):  # interleaved: each engine's collectives stay within its own group
            assert a.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True) == reference_tokens
            assert b.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True) == reference_tokens


XDIST_TEST = """
import os
import time
from pathlib import Path

import pytest

from engine_ref import LLM

BARRIER = Path({barrier!r})


def wait_for(suffix):
    deadline = time.monotonic() + 60
    while len(list(BARRIER.glob("*" + suffix))) < 2:
        assert time.monotonic() < deadline, "the other xdist worker never got there"
        time.sleep(0.02)


@pytest.mark.parametrize("i", [0, 1])
def test_engine(i):
    with LLM({model!r}, tensor_parallel_size=2, **{engine!r}) as llm:
        (BARRIER / f"{{i}}.up").write_text(os.environ["PYTEST_XDIST_WORKER"])
        wait_for(".up")  # both engines are alive now
        tokens = llm.generate({prompts!r}, max_tokens={max_tokens}, ignore_eos=True)
        (BARRIER / f"{{i}}.tokens").write_text(repr(tokens))
        wait_for(".tokens")
"""


def test_two_xdist_workers_do_not_collide(llama: Path, reference_tokens: list[list[int]],
                                          pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    barrier = pytester.mkdir("barrier")
    pytester.makepyfile(test_engines=XDIST_TEST.format(barrier=str(barrier), model=str(llama), engine=SMALL_ENGINE,
                                                       prompts=PROMPTS, max_tokens=MAX_TOKENS))
    # Each xdist worker forks its ranks itself: a forkserver per worker would add seconds and no coverage,
    # as what could collide (rendezvous, ports, shared memory) does not depend on the start method.
    monkeypatch.setenv("ENGINE_REF_WORKER_MULTIPROC_METHOD", "fork")
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(passed=2)
    assert {(barrier / f"{i}.up").read_text() for i in (0, 1)} == {"gw0", "gw1"}
    for i in (0, 1):
        assert (barrier / f"{i}.tokens").read_text() == repr(reference_tokens)


# -- parent death and interpreter exit -----------------------------------------------------------------


ENGINE_SCRIPT = """
import sys, time
from engine_ref import LLM

llm = LLM(sys.argv[1], tensor_parallel_size=2, **{engine!r})
print(llm.engine.executor.distributed_init_method, *(w.pid for w in llm.startup_report.workers), flush=True)
if sys.argv[2] == "hold":
    time.sleep(120)
# "exit": leave without shutdown(); the executor's atexit hook must stop the workers
"""


def _start_script(llama: Path, script_dir: Path, mode: str) -> subprocess.Popen[str]:
    script = script_dir / "engine_script.py"
    script.write_text(ENGINE_SCRIPT.format(engine=SMALL_ENGINE))
    return subprocess.Popen([sys.executable, str(script), str(llama), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(script_dir / "script-tmp")})


def _read_engine(proc: subprocess.Popen[str], timeout: float) -> tuple[Path, list[int]]:
    """The engine's rendezvous dir and its worker pids, as the script printed them."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        pytest.fail(f"the engine script printed no pids within {timeout} s: {proc.communicate()[1][-3000:]}")
    init_method, *pids = line.split()
    return Path(init_method.removeprefix("file://")).parent, [int(pid) for pid in pids]


@pytest.fixture
def script_dir() -> Iterator[Path]:
    """A short private dir for an engine script, and its TMPDIR (``script-tmp`` inside): a script killed on
    purpose cannot remove what it made there (multiprocessing's pymp-* dir), and the forkserver's Unix
    socket path under it must stay within AF_UNIX's 108 bytes, which pytest's tmp_path can exceed."""
    root = Path(tempfile.mkdtemp(prefix="er-mp-"))
    (root / "script-tmp").mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_workers_exit_when_the_parent_is_killed(llama: Path, script_dir: Path,
                                                procs: list[subprocess.Popen[str]]) -> None:
    proc = _start_script(llama, script_dir, "hold")
    procs.append(proc)
    rendezvous_dir, workers = _read_engine(proc, timeout=60)
    descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    assert set(workers) <= set(descendants)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(5)
    assert not wait_gone(descendants, timeout=5.0), "workers (or the forkserver) outlived their parent"
    assert not rendezvous_dir.exists(), "the engine's temp dir outlived it (it is not needed after startup)"


def test_workers_stop_at_interpreter_exit(llama: Path, script_dir: Path,
                                          procs: list[subprocess.Popen[str]]) -> None:
    proc = _start_script(llama, script_dir, "exit")
    procs.append(proc)
    rendezvous_dir, workers = _read_engine(proc, timeout=60)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr[-3000:]
    assert not wait_gone(workers, timeout=0.5), "atexit shutdown must reap the workers before the exit"
    assert not rendezvous_dir.exists()


# -- shutdown leaves nothing behind ------------------------------------------------------------------


def _listening_ports(processes: list[psutil.Process]) -> set[tuple[int, int]]:
    ports = set()
    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            ports |= {(proc.pid, c.laddr.port) for c in proc.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN}
    return ports


def _snapshot(tmp: Path) -> dict[str, Any]:
    me = psutil.Process()
    children = me.children(recursive=True)
    return {
        "children": {p.pid for p in children},
        "fds": me.num_fds(),
        "listening ports": _listening_ports([me, *children]),
        "temp entries": temp_entries(str(tmp)),  # and what this process's own temp dir holds
        "shared memory": unowned_shm_entries(),  # held by no other program on this machine
        "threads": sorted(t.name for t in threading.enumerate()),
    }


def _shm_inode(name: str) -> int | None:
    try:
        return os.stat(f"/dev/shm/{name}", follow_symlinks=False).st_ino
    except OSError:  # removed meanwhile
        return None


def test_twenty_start_stop_cycles_leave_nothing_behind(llama: Path, tiny_checkpoint: Callable[..., Path],
                                                       short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every 5th cycle is Llava with an image, so tensors travel to the workers (and torch's
    shared-memory pickling, which starts a thread and a socket here, would show)."""
    llava = tiny_checkpoint("LlavaForConditionalGeneration")
    image_prompt = [1, *[example_config("LlavaForConditionalGeneration")["image_token_index"]] * 16, 5]
    private_tmp = short_tmp
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    for model in (llama, llava):  # the forkserver, the ModelInfo cache and lazy imports, once
        with LLM(str(model), tensor_parallel_size=2, **SMALL_ENGINE):
            pass
    # /dev/shm is the machine's: a segment another program (a vLLM run beside this one) makes and leaves unheld
    # meanwhile is not this engine's leak; one that only this process tree held, or that no one was seen holding, is
    shm_watch = ForeignShmWatch()
    with shm_watch.paused():  # its look holds /proc files open: not in the fd count
        before = _snapshot(private_tmp)
    for cycle in range(20):
        with_image = cycle % 5 == 0
        llm = LLM(str(llava if with_image else llama), tensor_parallel_size=2, **SMALL_ENGINE)
        executor = executor_of(llm)
        store = Path(executor.distributed_init_method.removeprefix("file://"))
        assert store.parent.parent == Path(owner_dir()) and store.parent.parent.parent == private_tmp
        pids = [w.pid for w in llm.startup_report.workers]
        if with_image:
            llm.generate([image_prompt], max_tokens=2, images=[torch.zeros(3, 32, 32)], ignore_eos=True)
        llm.shutdown()
        llm.shutdown()  # idempotent
        assert not wait_gone(pids, timeout=0.5), f"cycle {cycle}: workers still running after shutdown"
    with shm_watch.paused():
        after = _snapshot(private_tmp)
    foreign = shm_watch.foreign()
    # new segments only: one another program left unheld before the cycles and removed meanwhile is not a difference
    new_shm = {name for name in after.pop("shared memory") - before.pop("shared memory")
               if _shm_inode(name) not in foreign}
    leaks = {what: {"before": before[what], "after": after[what]} for what in before if before[what] != after[what]}
    if new_shm:
        leaks["shared memory"] = {"new": new_shm}
    assert not leaks, f"left behind after 20 start/stop cycles: {leaks}"
