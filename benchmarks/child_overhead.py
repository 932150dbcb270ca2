"""What a check's process costs before any check runs: an empty warm fork, an empty spawn, a fresh interpreter.

Measured side by side in one run, samples interleaved:
- warm fork: ``run_isolated`` of an empty function under the default start method (a fork of the forkserver
  that preloaded torch and engine_ref's core, as every check child is), with its CallStats: the child's
  start (request to first instruction) and answer (return to value unpickled here);
- empty spawn: the same call under ENGINE_REF_WORKER_MULTIPROC_METHOD=spawn: a fresh interpreter that
  imports only the isolation mechanism (no torch: less than a check needs);
- fresh interpreter per check: ``python -c "import torch, engine_ref.warmup"``, what a check child would
  pay to reach the warm parent's state without forking it.

    python benchmarks/child_overhead.py [--repeat 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable


def empty() -> None:
    """The check that does nothing."""


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10, help="samples per side")
    args = parser.parse_args()

    from engine_ref.isolation import CallStats, ensure_warm_parent, last_call_stats, run_isolated

    ensure_warm_parent()
    run_isolated(empty)  # the warm parent has finished preloading

    def isolated(method: str | None) -> Callable[[], CallStats]:
        def call() -> CallStats:
            if method is not None:
                os.environ["ENGINE_REF_WORKER_MULTIPROC_METHOD"] = method
            try:
                run_isolated(empty)
            finally:
                os.environ.pop("ENGINE_REF_WORKER_MULTIPROC_METHOD", None)
            stats = last_call_stats()
            assert stats is not None
            return stats
        return call

    def fresh() -> float:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, engine_ref.warmup"], check=True)
        return time.perf_counter() - start

    os.environ.pop("ENGINE_REF_WORKER_MULTIPROC_METHOD", None)
    fork_stats: list[CallStats] = []
    spawn_stats: list[CallStats] = []
    fresh_s: list[float] = []
    for _ in range(args.repeat):
        fork_stats.append(isolated(None)())
        spawn_stats.append(isolated("spawn")())
        fresh_s.append(fresh())

    def row(name: str, stats: list[CallStats]) -> tuple[str, float, float, float, int, int]:
        return (name, median_ms([s.total_s for s in stats]), median_ms([s.start_s or 0.0 for s in stats]),
                median_ms([s.answer_s or 0.0 for s in stats]), stats[0].sent_bytes, stats[0].received_bytes or 0)

    rows = [row("warm fork (forkserver)", fork_stats), row("empty spawn", spawn_stats)]
    fork_total = rows[0][1]
    print(f"samples per side: {args.repeat} (medians), CPUs: {os.cpu_count()}, python {sys.version.split()[0]}")
    print(f"{'':34}{'total ms':>10}{'start ms':>10}{'answer ms':>11}{'sent B':>8}{'recv B':>8}{'x fork':>8}")
    for name, total, start, answer, sent, received in rows:
        print(f"{name:34}{total:10.1f}{start:10.1f}{answer:11.2f}{sent:8d}{received:8d}{total / fork_total:8.1f}")
    total = median_ms(fresh_s)
    print(f"{'fresh interpreter (import torch)':34}{total:10.1f}{'':10}{'':11}{'':8}{'':8}{total / fork_total:8.1f}")


if __name__ == "__main__":
    main()
