"""What a warm parent costs to start, once per pytest session, CLI or engine: CPU seconds of a fresh interpreter
importing its preload, side by side in one run, samples interleaved:
- engine_ref's preload (``engine_ref.warmup``: torch and the engine core), what every warm parent imports;
- the same plus ``torch._dynamo``, which the plugin adds for the checks that run the memory estimate (budget,
  quant: FakeTensorMode imports it) and which every warm parent used to import.

    python benchmarks/warm_parent.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys

PRELOADS = {"engine_ref.warmup": "import engine_ref.warmup",
            "engine_ref.warmup + torch._dynamo": "import engine_ref.warmup, torch._dynamo"}


def cpu_seconds(code: str) -> float:
    """User + system CPU of ``python -c code``, from the rusage of the reaped child."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {name: [] for name in PRELOADS}
    for _ in range(args.repeat):
        for name, code in PRELOADS.items():
            samples[name].append(cpu_seconds(code))
    base = statistics.median(samples["engine_ref.warmup"])
    print(f"{'warm parent preload':<36} {'CPU s (median)':>14} {'ratio':>6}")
    for name, values in samples.items():
        print(f"{name:<36} {statistics.median(values):>14.2f} {statistics.median(values) / base:>5.2f}x")


if __name__ == "__main__":
    main()
