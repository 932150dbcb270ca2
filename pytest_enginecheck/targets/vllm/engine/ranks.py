"""The warm layout's ranks: ``tp`` forks of this (warm, CUDA-free) process, each driving vLLM's engine.

TP=1 is one fork running vLLM's engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni``
executor); TP=N forks N ranks, each an engine of vLLM's ``external_launcher`` executor (vLLM's torchrun-style mode:
every rank runs the same deterministic scheduler and its own worker, joined by torch.distributed over gloo). The
ranks are waited for under one deadline (``engine_ref.isolation``'s ``AnswerWait``): at the deadline every rank
still running has its Python stacks in the failure and is killed; a rank that died is named by its exit; the
ranks' exit after their answers shares one grace (SHUTDOWN_GRACE_S).
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pytest_enginecheck.targets.vllm.engine.drive import (
    SHUTDOWN_GRACE_S,
    EngineRun,
    EngineStartError,
    EngineWork,
    drive,
)
from pytest_enginecheck.targets.vllm.failures import EngineFailure, classify
from pytest_enginecheck.targets.vllm.probe import engine_api

if TYPE_CHECKING:
    from engine_ref.isolation import AnswerWait, Deadline, WarmProcess


SHM_DIR = "/dev/shm"
SHM_MARK = "-cpushm"  # in the names of vLLM's CpuCommunicator's shared-memory all-reduce segments (_CPUSHMDistributed)
# vLLM's CPU all-reduce names its shared memory by TP rank alone (``-tp:0-[0-1]-cpushm_N``): two engines of TP>1 on one
# machine at once collide ("create shm in SHMManager failed. errno: 17"), so they take turns on this lock.
MULTIRANK_LOCK = "/tmp/pytest-enginecheck-vllm-multirank.lock"
FAILURE_GRACE_S = 2.0  # after a rank failed: how long the others may take to fail too (the first death is the cause)


def _rank_main(ckpt: str, tp: int, rank: int, port: int, ipc_dir: str,
               conn: multiprocessing.connection.Connection, engine_args: dict[str, Any], work: EngineWork) -> None:
    """One rank: vLLM's engine driven in this fork (``drive``), under --enginecheck-strict with the model's code
    under the CUDA guard (``cuda_ranks``, whose finding outranks whatever vLLM made of the guard's refusal); its
    outcome sent to ``_gather``."""
    import cloudpickle

    from pytest_enginecheck.targets.vllm.engine.cuda_ranks import rank_guard
    from pytest_enginecheck.targets.vllm.engine.ranklog import capture_output

    capture_output(_rank_log(ipc_dir, rank))  # _fork_ranks passes on what of it is about the outcome
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_RPC_BASE_PATH=ipc_dir)
    guard = rank_guard(rank, tp)  # None without --enginecheck-strict
    try:
        extra = {"distributed_executor_backend": "external_launcher"} if tp > 1 else {}
        extra.update(engine_args)
        with guard or contextlib.nullcontext():
            outcome: tuple = ("ok", drive(ckpt, tp, "warm", rank, extra, work))
    except EngineStartError as e:
        outcome = ("error", e.failure, str(e))
    except BaseException as e:  # noqa: BLE001 - anything else of this rank
        outcome = ("error", classify(e, rank), str(e))
    found = guard.failure() if guard is not None else None
    if found is not None:
        outcome = ("error", found, found.exception)
    conn.send_bytes(cloudpickle.dumps(outcome))
    conn.close()


def _rank_log(ipc_dir: str, rank: int) -> str:
    return os.path.join(ipc_dir, f"rank-{rank}.log")


def _relay_rank_logs(ipc_dir: str, ranks: range, failed: set[int]) -> None:
    """Write each rank's output, trimmed to what is about the outcome (``ranklog.trimmed_log``), to stderr."""

    from pytest_enginecheck.targets.vllm.engine.ranklog import trimmed_log

    for rank in ranks:
        try:
            with open(_rank_log(ipc_dir, rank), errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        sys.stderr.write(trimmed_log(text, rank in failed, f"vllm-rank-{rank}"))
    sys.stderr.flush()


def _gather(wait: AnswerWait[int], procs: dict[int, WarmProcess], timeout: float) -> list[EngineRun]:
    """Every rank's EngineRun in rank order; EngineStartError for the first rank that failed or died (a death
    wins over the errors that arrive within FAILURE_GRACE_S of it: its peers fail because it is gone), or for
    the ranks still running at the deadline, with all their stacks."""
    import cloudpickle

    from engine_ref.isolation import describe_exitcode

    runs: dict[int, EngineRun] = {}
    deaths: list[EngineStartError] = []
    errors: list[EngineStartError] = []
    for rank, message in wait:
        if message is None:  # it ended without a word
            procs[rank].join(1.0)
            what = describe_exitcode(procs[rank].exitcode)
            deaths.append(EngineStartError(EngineFailure("startup", rank, f"the rank process {what}", "", ""),
                                           f"rank {rank} {what} before returning a result"))
        else:
            outcome = cloudpickle.loads(message)
            if outcome[0] == "ok":
                runs[rank] = outcome[1]
                continue
            errors.append(EngineStartError(outcome[1], outcome[2]))
        wait.deadline.shorten(FAILURE_GRACE_S)
    if deaths or errors:
        for rank in wait.pending:  # waiting in a collective for a rank that failed: they cannot finish
            procs[rank].kill_tree()
        raise (deaths or errors)[0]
    if wait.pending:
        raise _timed_out(sorted(wait.pending), procs, timeout)
    return [runs[rank] for rank in sorted(runs)]


def _timed_out(pending: list[int], procs: dict[int, WarmProcess], timeout: float) -> EngineStartError:
    """The failure of the ranks that gave no result by the deadline: every one's Python stacks, then each killed."""
    stacks = {}
    for rank in pending:
        stacks[rank] = procs[rank].dump_stacks() or "(none could be read)"
        procs[rank].kill_tree()
    told = "\n".join(f"rank {rank}:\n{text.rstrip()}" for rank, text in stacks.items())
    ranks = ", ".join(str(rank) for rank in pending)
    failure = EngineFailure("timeout", pending[0], f"rank {ranks} gave no result within {timeout:g} s", "", told)
    return EngineStartError(failure, f"rank {ranks} did not finish within {timeout:g} s; their Python stacks at "
                                     f"that moment:\n{told}")


def _close_ranks(procs: dict[int, WarmProcess], grace: Deadline) -> list[dict[str, Any]]:
    """Give the ranks, all together, until ``grace`` to exit by themselves, then kill the rest (and what they
    started) and reap them all. Returns the ranks that had to be killed, each with its Python stacks (every thread's)
    read before the kill: a rank that answered and still runs waits for a non-daemon thread (``threading._shutdown``
    at a process' exit joins them), and its stacks say which."""
    for proc in procs.values():
        proc.join(grace.remaining())
    killed = [{"rank": rank, "stacks": proc.dump_stacks() or "(none could be read)"}
              for rank, proc in procs.items() if proc.is_alive()]
    for proc in procs.values():
        proc.close()
    return killed


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def _remove_left_shm(before: set[str], python_segments: bool = True) -> None:
    """Unlink vLLM's CPU all-reduce segments (``<ident>-tp:0-[0-1]-cpushm_<rank>``) that appeared since ``before``
    and no process holds. vLLM unlinks them in a static destructor, which runs at a normal interpreter exit but
    not when a forked rank leaves by os._exit (nor when it is killed); and it names them alike for every
    external-launcher engine (``VLLM_DIST_IDENT`` comes from the ``env://`` init method), so the next TP=N start
    on this machine would fail with errno 17 (EEXIST) in ``init_device``.

    With ``python_segments``, also the Python SharedMemory segments (``psm_*``) that appeared: rank 0's shared-memory
    broadcast of the TP group (vLLM's MessageQueue, 24 MiB), which vLLM unlinks only when the group is destroyed, so
    a rank that failed or was killed leaves it, registered with the resource tracker of the warm parent's tree, which
    reports it at the end of the run ("There appear to be N leaked shared_memory objects")."""
    from pytest_enginecheck.leaks import PYTHON_SHM_PREFIX, remove_left_segments

    remove_left_segments(name for name in _shm_entries() - before
                         if SHM_MARK in name or (python_segments and name.startswith(PYTHON_SHM_PREFIX)))


@contextlib.contextmanager
def _one_multirank_engine_at_a_time(deadline: Deadline) -> Iterator[None]:
    """Hold MULTIRANK_LOCK (machine-wide) while a TP>1 engine runs, waiting for it no longer than ``deadline``."""
    fd = os.open(MULTIRANK_LOCK, os.O_CREAT | os.O_RDWR, 0o666)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline.expired():
                    message = (f"another vLLM engine of tensor_parallel_size>1 ran on this machine for the whole "
                               f"{deadline.seconds:g} s (vLLM's CPU all-reduce names its shared memory by rank, "
                               f"so two cannot run at once; {MULTIRANK_LOCK})")
                    raise EngineStartError(EngineFailure("timeout", 0, message, "", ""), message) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def run_ranks(ckpt: str, tp: int, timeout: float, engine_args: dict[str, Any], work: EngineWork) -> EngineRun:
    """Fork ``tp`` ranks and wait for each one's EngineRun under one deadline (engine_ref.isolation's wait)."""
    from engine_ref.isolation import Deadline

    deadline = Deadline(timeout)
    if tp == 1:
        return _fork_ranks(ckpt, tp, deadline, engine_args, work)
    with _one_multirank_engine_at_a_time(deadline):
        # What an engine killed mid-run left (a check's timeout kills its whole tree before _remove_left_shm runs):
        # under the lock no other TP>1 engine of ours runs, so a segment nobody maps is a leftover, not a peer's.
        _remove_left_shm(set(), python_segments=False)  # a psm_* nobody holds may be another tree's, its tracker's
        return _fork_ranks(ckpt, tp, deadline, engine_args, work)


def _fork_ranks(ckpt: str, tp: int, deadline: Deadline, engine_args: dict[str, Any], work: EngineWork) -> EngineRun:
    """The ranks under ``deadline`` (the start's Deadline; what the lock waited is already spent from it)."""
    from engine_ref.isolation import AnswerWait, Deadline, start_process

    ctx = multiprocessing.get_context("fork")  # forks of this (warm, CUDA-free) process
    port = engine_api().get_open_port()
    # vLLM's shared-memory broadcast binds ZeroMQ IPC files here; a forked rank leaves by os._exit, which
    # never closes them (a normal interpreter exit would), so the directory goes with the ranks.
    ipc_dir = tempfile.mkdtemp(prefix="vllm-ipc-")
    procs: dict[int, WarmProcess] = {}
    readers: dict[int, multiprocessing.connection.Connection] = {}
    shm_before = _shm_entries()
    failed = set(range(tp))  # the ranks whose output is about a failure: all of them, until they answered
    killed: list[dict[str, Any]] = []
    try:
        for rank in range(tp):
            reader, writer = ctx.Pipe(duplex=False)
            readers[rank] = reader
            procs[rank] = start_process(_rank_main, ckpt, tp, rank, port, ipc_dir, writer, engine_args, work,
                                        name=f"vllm-rank-{rank}", ctx=ctx)
            writer.close()
        wait = AnswerWait(readers, {rank: proc.sentinel for rank, proc in procs.items()}, deadline)
        runs = _gather(wait, procs, deadline.seconds or 0.0)
        failed = set()
    except EngineStartError as e:
        failed = {e.failure.rank}
        raise
    finally:
        killed = _close_ranks(procs, Deadline(SHUTDOWN_GRACE_S))
        for reader in readers.values():
            reader.close()
        _relay_rank_logs(ipc_dir, range(len(procs)), failed)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        _remove_left_shm(shm_before)
    run = runs[0]
    run.memory = [m for r in runs for m in r.memory]
    run.captures = [c for r in runs for c in r.captures]
    run.workload = [[m for r in runs for m in r.workload[i]] for i in range(len(run.workload))]
    run.seconds = {k: max(r.seconds.get(k, 0.0) for r in runs) for k in run.seconds}
    run.killed_ranks = killed
    return run
