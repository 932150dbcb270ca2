"""Engine startup, measured side by side in one run on a tiny checkpoint.

    python benchmarks/startup.py [--architecture LlamaForCausalLM] [--repeats 5] [--cycles 50] [--deaths 10]

Prints (medians over ``--repeats`` runs, after one warm-up that starts the forkserver):
- engine startup (LLM construction) at TP=1 (in-process worker) and TP=2 (two WorkerProcs), and their ratio;
- worker start: from asking for a process to that process having torch and engine_ref's worker
  imported, for a fork of the warm forkserver, a fork of this process, and a fresh (spawned) interpreter;
- TP=2 engine startup with spawned workers, against the default;
- ``--cycles`` start / generate / stop cycles at TP=2: this process's RSS, open fds and threads and its live
  descendants (and their RSS) before the first cycle, halfway and after the last; shutdown seconds; how the
  workers ended (by themselves, or needing SIGTERM / SIGKILL);
- ``--deaths`` times per signal: a TP=2 engine's rank 1 is sent SIGKILL or SIGSEGV after READY; milliseconds
  until the executor has marked the engine dead (every later call raises EngineDeadError naming the rank); each
  SIGSEGV'd worker prints its Python stacks on stderr (faulthandler), as it should.
0 skips either.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from engine_ref import LLM, make_checkpoint
from engine_ref.executor.multiproc import MultiprocExecutor
from engine_ref.isolation import run_isolated
from engine_ref.isolation.tempdirs import owner_dir
from pytest_enginecheck.leaks import descendants

ENGINE = {"device_memory": "64MiB", "max_model_len": 64, "max_num_batched_tokens": 64}


@contextmanager
def start_method(method: str) -> Iterator[None]:
    previous = os.environ.get("ENGINE_REF_WORKER_MULTIPROC_METHOD")
    os.environ["ENGINE_REF_WORKER_MULTIPROC_METHOD"] = method
    try:
        yield
    finally:
        if previous is None:
            del os.environ["ENGINE_REF_WORKER_MULTIPROC_METHOD"]
        else:
            os.environ["ENGINE_REF_WORKER_MULTIPROC_METHOD"] = previous


def median_of(repeats: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(repeats))


def engine_startup_s(model: Path, tp: int) -> float:
    """Seconds to construct the engine (plugins, config, workers, KV cache, report)."""
    start = time.perf_counter()
    llm = LLM(str(model), tensor_parallel_size=tp, **ENGINE)
    seconds = time.perf_counter() - start
    llm.shutdown()
    return seconds


def _ready_at() -> float:
    """Runs in the child: import what a worker needs, then say when (CLOCK_MONOTONIC is system-wide)."""
    import torch  # noqa: F401 - the import is what is timed

    import engine_ref.worker.worker  # noqa: F401 - the import is what is timed

    return time.monotonic()


def worker_start_s() -> float:
    """Seconds from asking for a child (the current start method) to the child having a worker's imports."""
    start = time.monotonic()
    return run_isolated(_ready_at, timeout=120) - start


def _rss_mib(pid: int | str) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):  # gone meanwhile
        return 0.0


def usage() -> dict[str, float]:
    """What this process holds now: RSS, open fds, threads, live descendants and their RSS."""
    children = descendants(os.getpid())
    return {"RSS, MiB": _rss_mib("self"), "open fds": len(os.listdir("/proc/self/fd")),
            "threads": threading.active_count(), "live descendants": len(children),
            "  their RSS, MiB": sum(_rss_mib(pid) for pid in children)}


def cycles(model: Path, n: int) -> tuple[list[dict[str, float]], list[float], Counter[str]]:
    """``n`` TP=2 start / generate / stop cycles: usage before, halfway and after; shutdown seconds; how workers
    ended."""
    samples, shutdown_s, ended = [usage()], [], Counter[str]()
    for cycle in range(1, n + 1):
        llm = LLM(str(model), tensor_parallel_size=2, **ENGINE)
        llm.generate([[1, 5, 9]], max_tokens=2, ignore_eos=True)
        start = time.perf_counter()
        llm.shutdown()
        shutdown_s.append(time.perf_counter() - start)
        ended.update(end.ended_by for end in llm.engine.worker_exits)
        if cycle in (n // 2, n):
            samples.append(usage())
    return samples, shutdown_s, ended


def death_noticed_ms(model: Path, sig: signal.Signals) -> float:
    """Milliseconds from sending ``sig`` to rank 1 of a ready TP=2 engine to the engine being marked dead."""
    with LLM(str(model), tensor_parallel_size=2, **ENGINE) as llm:
        executor = llm.engine.executor
        assert isinstance(executor, MultiprocExecutor)
        os.kill(llm.startup_report.workers[1].pid, sig)
        sent = time.monotonic()
        while executor.dead_reason is None and time.monotonic() - sent < 10:
            time.sleep(0.0005)
        if executor.dead_reason is None:
            raise RuntimeError(f"the engine was not marked dead within 10 s of {sig.name}")
        return (time.monotonic() - sent) * 1000


def print_cycles(n: int, samples: list[dict[str, float]], shutdown_s: list[float], ended: Counter[str]) -> None:
    columns = ["before", *([f"after {n // 2}"] if n > 1 else []), f"after {n}"]
    print(f"\n{f'{n} start / generate / stop cycles at TP=2':<44}" + "".join(f"{c:>12}" for c in columns))
    for key in samples[0]:
        print(f"{'  ' + key:<44}" + "".join(f"{sample[key]:>12.1f}" if "MiB" in key else f"{sample[key]:>12.0f}"
                                           for sample in samples))
    print(f"{'  shutdown seconds: median, max':<44}{statistics.median(shutdown_s):>12.3f}{max(shutdown_s):>12.3f}")
    print(f"{'  workers that ended by themselves':<44}{ended['itself']:>12} of {sum(ended.values())}"
          + "".join(f", {count} needed {how}" for how, count in ended.items() if how != "itself"))


def print_deaths(deaths: dict[str, list[float]]) -> None:
    n = len(next(iter(deaths.values())))
    print(f"\n{f'engine marked dead after a worker death ({n} runs)':<44}{'min ms':>12}{'median ms':>12}{'max ms':>12}")
    for name, ms in deaths.items():
        print(f"{'  rank 1 got ' + name:<44}{min(ms):>12.1f}{statistics.median(ms):>12.1f}{max(ms):>12.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architecture", default="LlamaForCausalLM")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=50, help="TP=2 start/stop cycles to measure (0: none)")
    parser.add_argument("--deaths", type=int, default=10, help="worker deaths per signal to time (0: none)")
    args = parser.parse_args()
    n = args.repeats

    with tempfile.TemporaryDirectory(prefix="bench-", dir=owner_dir()) as tmp:
        model = make_checkpoint(args.architecture, Path(tmp) / args.architecture)
        with start_method("forkserver"):
            engine_startup_s(model, 2)  # warm-up: the forkserver, the ModelInfo cache, lazy imports
            engine_startup_s(model, 1)
            tp1 = median_of(n, lambda: engine_startup_s(model, 1))
            tp2 = median_of(n, lambda: engine_startup_s(model, 2))
            warm = median_of(n, worker_start_s)
        with start_method("fork"):
            fork = median_of(n, worker_start_s)
        with start_method("spawn"):
            spawn = median_of(n, worker_start_s)
            tp2_spawn = median_of(max(1, n // 2), lambda: engine_startup_s(model, 2))
        with start_method("forkserver"):
            cycled = cycles(model, args.cycles) if args.cycles > 0 else None
            logging.getLogger("engine_ref").setLevel(logging.CRITICAL)  # each death logs an error: expected here
            deaths = {sig.name: [death_noticed_ms(model, sig) for _ in range(args.deaths)]
                      for sig in (signal.SIGKILL, signal.SIGSEGV)} if args.deaths > 0 else None

    print(f"engine_ref startup: tiny {args.architecture}, median of {n} runs, {os.cpu_count()} CPUs\n")
    print(f"{'engine startup':<44}{'seconds':>10}")
    print(f"{'  TP=1 (uni: worker in this process)':<44}{tp1:>10.3f}")
    print(f"{'  TP=2 (mp: 2 WorkerProcs from forkserver)':<44}{tp2:>10.3f}")
    print(f"{'  TP=2 / TP=1':<44}{tp2 / tp1:>9.1f}x\n")
    print(f"{'worker start (until torch + worker imported)':<44}{'seconds':>10}")
    print(f"{'  fork of the warm forkserver (default)':<44}{warm:>10.3f}")
    print(f"{'  fork of this process':<44}{fork:>10.3f}")
    print(f"{'  spawn (a fresh interpreter)':<44}{spawn:>10.3f}")
    print(f"{'  spawn / warm fork':<44}{spawn / warm:>9.0f}x\n")
    print(f"{'  TP=2 engine startup with spawned workers':<44}{tp2_spawn:>10.3f}")
    print(f"{'  ... / with forkserver workers':<44}{tp2_spawn / tp2:>9.1f}x")
    if cycled is not None:
        print_cycles(args.cycles, *cycled)
    if deaths is not None:
        print_deaths(deaths)


if __name__ == "__main__":
    main()
