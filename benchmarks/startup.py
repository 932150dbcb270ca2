"""Engine startup, measured side by side in one run on a tiny checkpoint.

    python benchmarks/startup.py [--architecture LlamaForCausalLM] [--repeats 5]

Prints (medians over ``--repeats`` runs, after one warm-up that starts the forkserver):
- engine startup (LLM construction) at TP=1 (in-process worker) and TP=2 (two WorkerProcs), and their ratio;
- worker start: from asking for a process to that process having torch and engine_ref's worker
  imported, for a fork of the warm forkserver, a fork of this process, and a fresh (spawned) interpreter;
- TP=2 engine startup with spawned workers, against the default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from engine_ref import LLM, make_checkpoint
from engine_ref.isolation import run_isolated

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architecture", default="LlamaForCausalLM")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = args.repeats

    with tempfile.TemporaryDirectory(prefix="engine_ref-bench-") as tmp:
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


if __name__ == "__main__":
    main()
