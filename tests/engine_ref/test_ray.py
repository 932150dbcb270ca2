"""RayDistributedExecutor against a real local Ray: same tokens, same report, nothing left running.

Ray is the optional extra ``ray``; CI installs it (``pip install '.[test,ray]'``), and only its
absence skips these tests.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from engine_ref import LLM
from engine_ref.config.parallel import DEFAULT_RPC_TIMEOUT_S
from engine_ref.errors import WorkerStartupError
from engine_ref.executor import ray_distributed
from engine_ref.executor.protocol import RpcTimeoutError
from engine_ref.executor.ray_distributed import RayDistributedExecutor
from engine_ref.isolation import RemoteTraceback
from tests import fault_models
from tests.fault_models import fault_overrides
from tests.helpers import LLAMA, MAX_SHARE_READ_AT_TP2, checkpoint_bytes, wait_gone

# A marker, not importorskip: a run that deselects these tests (the main job's -m enginecheck) reports no skip of them.
ray: Any = importlib.import_module("ray") if importlib.util.find_spec("ray") else None
pytestmark = pytest.mark.skipif(ray is None, reason="ray is not installed; install the extra: pip install '.[ray]'")

ENGINE: dict[str, Any] = {"device_memory": "64MiB", "max_model_len": 64, "max_num_batched_tokens": 64,
                          "distributed_executor_backend": "ray", "tensor_parallel_size": 2}
PROMPTS = [[1, 5, 9, 13, 17], [7, 3]]
# How long Ray may take to reap the actors it was told to kill (wait_gone returns as soon as they are gone): 10 s
# was too short with two README test runs at once (load average 21), where a failed engine's actors took longer.
ACTORS_GONE_S = 60
MAX_TOKENS = 4


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


def actor_processes() -> set[int]:
    """Our Ray's actor processes that run an engine rank (Ray titles them ``ray::RayWorkerWrapper``)."""
    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if "RayWorkerWrapper" in " ".join(proc.cmdline()):
                found.add(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture
def no_ray_running() -> Iterator[None]:
    assert not ray.is_initialized(), "a Ray from an earlier test is still running"
    yield
    if ray.is_initialized():  # a failed test must not leave its Ray to the next one
        ray.shutdown()


def test_ray_tp2_matches_tp1_and_stops_the_ray_it_started(tiny_checkpoint: Callable[..., Path],
                                                          no_ray_running: None) -> None:
    model = tiny_checkpoint(LLAMA)
    with LLM(str(model), device_memory="64MiB", max_model_len=64, max_num_batched_tokens=64) as reference:
        expected = reference.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)
    before = descendants()

    with LLM(str(model), **ENGINE) as llm:
        assert {w.pid for w in llm.startup_report.workers} == actor_processes()
        executor = llm.engine.executor
        assert isinstance(executor, RayDistributedExecutor) and executor.started_ray
        assert ray.is_initialized()
        assert llm.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True) == expected
        report = llm.startup_report
        tmp_dir = Path(executor.distributed_init_method.removeprefix("file://")).parent

    assert report.executor_backend == "ray" and [w.rank for w in report.workers] == [0, 1]
    pids = {w.pid for w in report.workers}
    assert len(pids) == 2 and os.getpid() not in pids
    total = checkpoint_bytes(model)
    for worker in report.workers:
        assert 0 < worker.bytes_read <= MAX_SHARE_READ_AT_TP2 * total
        assert set(worker.phases) >= {"init_device", "load_model", "profile_run", "initialize_cache"}
        assert worker.memory.weights > 0 and worker.memory.kv_cache > 0
    assert len({w.memory.kv_cache for w in report.workers}) == 1

    assert not ray.is_initialized(), "the executor started Ray, so its shutdown must stop it"
    assert not wait_gone(pids, timeout=ACTORS_GONE_S), "Ray actors outlived the engine"
    assert not wait_gone(descendants() - before, timeout=ACTORS_GONE_S), "Ray's processes outlived the engine"
    assert not tmp_dir.exists()


@pytest.fixture
def caller_ray(no_ray_running: None) -> Iterator[None]:
    session_dir = tempfile.mkdtemp(prefix="ray-")  # short: Ray puts unix sockets there
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=session_dir)
    yield
    ray.shutdown()
    shutil.rmtree(session_dir, ignore_errors=True)


def test_ray_worker_failure_names_rank_and_leaves_the_callers_ray(tiny_checkpoint: Callable[..., Path],
                                                                  caller_ray: None) -> None:
    with fault_models.registered() as arch:
        model = tiny_checkpoint(arch, overrides=fault_overrides("raise", "load_weights"))
        with pytest.raises(WorkerStartupError) as info:
            LLM(str(model), **ENGINE)
    message = str(info.value)
    assert message.startswith("Worker rank 1 (pid ")
    assert "failed in load_model: tests.fault_models.InjectedFault: injected fault on rank 1" in message
    assert isinstance(info.value.__cause__, RemoteTraceback) and "_maybe_fail" in info.value.__cause__.text
    assert ray.is_initialized(), "a Ray the caller started must be left running"
    assert not wait_gone(actor_processes(), timeout=ACTORS_GONE_S), "the failed engine's actors were not killed"


def test_ray_hung_worker_is_dumped_and_killed_at_the_ready_timeout(tiny_checkpoint: Callable[..., Path],
                                                                  caller_ray: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver reads the hung actor's stacks as faulthandler writes them (a named pipe), with no fixed sleep.

    The wait is timed from the ready deadline's start to the first stack dump (the wait giving up), so neither the
    engine's setup before it nor the shutdown grace after it (a hung actor never answers) counts: one deadline
    for both of startup's waits ends before a second ``timeout_s`` could, whatever the machine's load. Ray actors
    are fresh interpreters: where rank 1 had not yet reached the planted hang at the deadline (its stacks show no
    ``_maybe_fail``: a loaded machine), the engine is started again with a deadline 4 times as long, and every
    assertion holds for the start that reached it."""
    marks: dict[str, float] = {}

    class TimedDeadline(ray_distributed.Deadline):
        def __init__(self, seconds: float | None) -> None:
            marks.setdefault("deadline", time.monotonic())
            super().__init__(seconds)

    dump_stacks = RayDistributedExecutor._dump_stacks

    def timed_dump_stacks(self: RayDistributedExecutor, rank: int) -> str:
        marks.setdefault("gave_up", time.monotonic())
        return dump_stacks(self, rank)

    monkeypatch.setattr(ray_distributed, "Deadline", TimedDeadline)
    monkeypatch.setattr(RayDistributedExecutor, "_dump_stacks", timed_dump_stacks)
    for timeout_s in (20.0, 80.0):  # Ray actors are fresh interpreters: they need seconds before they can hang
        marks.clear()
        # A retry starts once Ray has the first start's CPUs back (its killed actors release them a moment later).
        freed = time.monotonic() + 60
        while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < freed:
            time.sleep(0.1)
        with fault_models.registered() as arch:
            model = tiny_checkpoint(arch, overrides=fault_overrides("hang", "load_weights"))
            start = time.monotonic()
            with pytest.raises(WorkerStartupError) as info:
                LLM(str(model), **ENGINE, ready_timeout_s=timeout_s)
        seconds = time.monotonic() - start
        message = str(info.value)
        if "_maybe_fail" in message:
            break
    assert f"Worker rank 1 was not ready within {timeout_s:g} s (ready_timeout_s" in message
    assert "check that Ray has 2 free CPUs" in message
    assert "fault_models.py" in message and "_maybe_fail" in message and "load_model" in message
    assert timeout_s <= seconds
    assert marks["gave_up"] - marks["deadline"] < 2 * timeout_s, "one ready deadline, not one per wait"
    assert not wait_gone(actor_processes(), timeout=ACTORS_GONE_S), "the hung engine's actors were not killed"


def test_ray_stopped_worker_fails_generate_within_the_rpc_timeout(tiny_checkpoint: Callable[..., Path],
                                                                 caller_ray: None) -> None:
    """Rank 1's actor stopped (SIGSTOP): generate raises at rpc_timeout_s with both ranks' stacks, not never."""
    timeout_s = 3.0
    with LLM(str(tiny_checkpoint(LLAMA)), **ENGINE) as llm:
        # From now on: the actors' first profile run (fresh interpreters, lazy imports) can take longer here.
        llm.engine.executor.config.parallel_config.rpc_timeout_s = timeout_s
        pids = {w.rank: w.pid for w in llm.startup_report.workers}
        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RpcTimeoutError) as info:
            llm.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)
        seconds = time.monotonic() - start
    # The message's 3 s is the value ray.get waited with; the default the engine started with did not end it.
    assert timeout_s <= seconds < DEFAULT_RPC_TIMEOUT_S, seconds
    assert (info.value.method, info.value.ranks) == ("execute_model", [0, 1])
    assert str(info.value).startswith(f"execute_model did not finish on rank 0, 1 within {timeout_s:g} s")
    assert "in all_reduce" in info.value.stacks[0]
    assert info.value.stacks[1].startswith("It was stopped (SIGSTOP, or a debugger)")
    assert not wait_gone(set(pids.values()), timeout=ACTORS_GONE_S), "the actors are killed with the engine"
