"""How each worker ended at shutdown (engine_ref.executor.shutdown), and the startup check that reads it.

The planted bug is tests/plugin_zoo/zoo/planted_thread.py: a Llama whose layer 1 starts a non-daemon poller thread
when built, so the process that built it cannot exit by itself. Its multiprocess workers must be recorded as
needing SIGTERM, with the thread's name, target and stack; the in-process (uni) engine must name the thread it
left running; the startup check must fail on it at TP=2 and TP=1, and its clean twin must pass. Its checkpoint is
the tiny Llama's under the planted architecture (building the model here would start the thread in pytest).
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_ref import LLM
from engine_ref.executor.shutdown import IN_PROCESS, WorkerExit, describe_exits
from engine_ref.isolation import run_isolated
from pytest_enginecheck.checks import CheckContext, CheckResult
from pytest_enginecheck.settings import Settings
from tests.helpers import SMALL_ENGINE

ZOO = Path(__file__).parents[1] / "plugin_zoo"
SPEC = "zoo.planted:REGISTRY"
POLLER, TWIN = "PollerThreadLlamaForCausalLM", "CleanTwinLlamaForCausalLM"
THREAD = "'kv-stats-poller-1' (target zoo.planted_thread.poll_kv_stats)"


@pytest.fixture(scope="module")
def zoo_on_path() -> Iterator[None]:
    """The zoo importable here and in every child (they get this process's sys.path), with the poller registered
    in the global registry for the engines this module starts."""
    from engine_ref.model_executor.models.registry import ModelRegistry

    sys.path.insert(0, str(ZOO))
    ModelRegistry.register_model(POLLER, f"zoo.planted_thread:{POLLER}")
    try:
        yield
    finally:
        ModelRegistry.models.pop(POLLER, None)
        sys.path.remove(str(ZOO))


@pytest.fixture(scope="module")
def poller(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory, zoo_on_path: None
           ) -> Path:
    """The tiny Llama's checkpoint, relabelled as the planted architecture."""
    path = tmp_path_factory.mktemp("poller") / POLLER
    shutil.copytree(tiny_checkpoint("LlamaForCausalLM"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": [POLLER]}))
    return path


def shut_down(model: Path, tp: int, thread_grace_s: float = 0.2, **kwargs: Any) -> list[WorkerExit]:
    """Start and stop an engine on ``model``; how its workers ended."""
    llm = LLM(str(model), tensor_parallel_size=tp, **SMALL_ENGINE, **kwargs)
    llm.engine.executor.thread_grace_s = thread_grace_s
    llm.shutdown()
    return llm.engine.worker_exits


def test_a_worker_kept_alive_by_a_thread_needs_sigterm_and_names_it(poller: Path, llama: Path) -> None:
    ends = shut_down(poller, 2)
    assert [(e.rank, e.ended_by, e.status) for e in ends] == [(0, "SIGTERM", "was killed by SIGTERM"),
                                                             (1, "SIGTERM", "was killed by SIGTERM")]
    for end in ends:
        assert not end.clean
        (thread,) = end.threads
        assert (thread.name, thread.target) == ("kv-stats-poller-1", "zoo.planted_thread.poll_kv_stats")
        assert thread.stack.splitlines()[-2:] == [f'  File "{ZOO / "zoo" / "planted_thread.py"}", line 18, in '
                                                  f'poll_kv_stats', "    time.sleep(0.05)"]
    how, stacks = describe_exits(ends)
    assert how == (f"rank 0 (pid {ends[0].pid}) and rank 1 (pid {ends[1].pid}) did not exit by themselves and "
                   f"needed SIGTERM (each was killed by SIGTERM); still running after their teardown: non-daemon "
                   f"thread {THREAD}")
    assert stacks.startswith(f"--- rank 0, 1: thread {THREAD} ---\n")
    clean = shut_down(llama, 2)
    assert [(e.ended_by, e.status, e.threads, e.clean) for e in clean] == [("itself", "exited with code 0", (),
                                                                            True)] * 2


def _in_process_exits(poller: str, llama: str) -> tuple[list[WorkerExit], list[WorkerExit]]:
    """In a child of its own: the poller thread the uni engine leaves behind dies with the child."""
    from engine_ref.model_executor.models.registry import ModelRegistry

    ModelRegistry.register_model(POLLER, f"zoo.planted_thread:{POLLER}")
    return shut_down(Path(poller), 1), shut_down(Path(llama), 1)


def test_the_in_process_engine_names_the_thread_it_left_running(poller: Path, llama: Path) -> None:
    planted, clean = run_isolated(_in_process_exits, str(poller), str(llama), timeout=120)
    (end,) = planted
    assert (end.ended_by, end.status, [t.name for t in end.threads]) == ("itself", IN_PROCESS, ["kv-stats-poller-1"])
    assert end.describe() == (f"rank 0 (pid {end.pid}), in this process, shut down but left non-daemon thread "
                              f"{THREAD} running")
    assert "in poll_kv_stats" in end.threads[0].stack
    assert [(e.threads, e.clean) for e in clean] == [((), True)]


def test_a_teardown_that_hangs_has_its_stacks_dumped_before_sigterm(llama: Path) -> None:
    llm = LLM(str(llama), tensor_parallel_size=2, **SMALL_ENGINE)
    executor = llm.engine.executor

    def stall_teardown(worker: Any) -> None:  # runs in each rank
        if worker.rank == 1:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            worker.shutdown = lambda: time.sleep(60)

    executor.collective_rpc(stall_teardown)
    executor.shutdown_grace_s, executor.terminate_grace_s = 2.0, 0.3
    llm.shutdown()
    rank0, rank1 = llm.engine.worker_exits
    assert rank0.status == "exited with code 0"
    assert (rank1.ended_by, rank1.status, rank1.threads) == ("SIGKILL", "was killed by SIGKILL", ())
    assert rank1.describe() == (f"rank 1 (pid {rank1.pid}) did not exit by itself and needed SIGKILL (it was killed "
                                f"by SIGKILL): it did not finish its teardown")
    assert "in <lambda>" in rank1.stacks and "in worker_main" in rank1.stacks, rank1.stacks


@pytest.fixture(scope="module")
def startup_results(tmp_path_factory: pytest.TempPathFactory, zoo_on_path: None) -> dict[tuple[str, int], CheckResult]:
    """The startup check of the planted model at the largest TP size 2 (mp) and 1 (uni), and of its twin at 2 (the
    in-process test above shows the twin's clean exit at 1)."""
    from engine_ref.isolation import add_preload_modules
    from pytest_enginecheck.checks.runner import run_check
    from pytest_enginecheck.session import CHILD_MODULES

    add_preload_modules(*CHILD_MODULES)
    workdir = str(tmp_path_factory.mktemp("startup"))
    modules = {POLLER: "zoo.planted_thread", TWIN: "zoo.planted_clean"}
    return {(arch, tp): run_check(CheckContext(check="startup", spec=SPEC, architecture=arch, module=module,
                                               class_name=arch, workdir=workdir,
                                               options=Settings(tp_sizes=tuple(range(1, tp + 1)))))
            for arch, module in modules.items() for tp in ((2, 1) if arch == POLLER else (2,))}


@pytest.mark.parametrize("tp", [2, 1])
def test_the_startup_check_fails_a_model_whose_thread_outlives_the_engine(
        startup_results: dict[tuple[str, int], CheckResult], tp: int) -> None:
    result = startup_results[POLLER, tp]
    assert (result.outcome, result.detail.get("kind")) == ("failed", "unclean_shutdown"), result.message
    first = result.message.splitlines()[0]
    assert first.startswith(f"{POLLER} started at tensor_parallel_size={tp}, but did not shut down cleanly: rank 0 ")
    assert f"non-daemon thread {THREAD}" in first
    assert ("needed SIGTERM" in first) == (tp == 2)
    assert "Stacks:\n--- rank 0" in result.message and "in poll_kv_stats\n    time.sleep(0.05)" in result.message


def test_the_clean_twin_passes_the_startup_check(startup_results: dict[tuple[str, int], CheckResult]) -> None:
    result = startup_results[TWIN, 2]
    assert result.outcome == "passed", result.message
    assert result.detail["tensor_parallel_size"] == 2
