"""What the import profile costs: the same import with and without ImportProfiler, side by side in one run.

Two settings, samples alternating (ABBA) so that drift and warm file caches hit both sides alike:
- check: what the import check does, in a fork of the warm parent (torch preloaded): import each bundled
  model's module, with and without the profiler around it (in one child per module, which removes what
  the import loaded from sys.modules before each sample, so that forks add no noise);
- cold: a fresh interpreter importing ``--module`` (torch and all it pulls in, ~1,000 modules): the worst
  case per module, far more imports than a check makes.

On a busy machine the two sides' medians differ by noise larger than the profiler's cost, so the
benchmark also measures that cost directly: the hook's time per recorded import (100,000 calls around
a no-op import), times the modules an import records, against that import's time: a bound.

    python benchmarks/import_profile.py [--repeat 100] [--cold-repeat 6] [--module MODULE]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COLD = """
import sys, time
from pytest_enginecheck.import_profile import ImportProfiler
profile = sys.argv[2] == "1"
start = time.perf_counter()
if profile:
    with ImportProfiler() as profiler:
        __import__(sys.argv[1])
else:
    __import__(sys.argv[1])
print(time.perf_counter() - start, len(profiler.records) if profile else 0)
"""


def import_in_child(module: str, repeat: int) -> tuple[list[float], list[float], int]:
    """In one warm child: import ``module`` ``2 * repeat`` times, alternately with and without the profiler,
    each time after removing from sys.modules what its first import loaded (so every import runs the same
    module bodies); the seconds of each side and the modules recorded per import."""
    import importlib

    from pytest_enginecheck.import_profile import ImportProfiler

    before = set(sys.modules)
    importlib.import_module(module)
    loaded = set(sys.modules) - before
    plain: list[float] = []
    profiled: list[float] = []
    recorded = 0
    for i in range(2 * repeat):
        for name in loaded:
            del sys.modules[name]
        start = time.perf_counter()
        if i % 4 in (0, 3):  # ABBA
            importlib.import_module(module)
            plain.append(time.perf_counter() - start)
        else:
            with ImportProfiler() as profiler:
                importlib.import_module(module)
            profiler.top()  # the check also ranks them
            profiled.append(time.perf_counter() - start)
            recorded = len(profiler.records)
    return plain, profiled, recorded


def hook_cost_s(calls: int = 100_000) -> float:
    """Seconds the profiler's hook adds to one recorded import (its own work, around a no-op import)."""
    from pytest_enginecheck.import_profile import ImportProfiler

    def noop(name: str, import_: object) -> None:
        return None

    profiler = ImportProfiler()
    profiler._original = noop  # type: ignore[assignment]
    profiler._thread = __import__("threading").get_ident()
    name = "benchmark.not.a.loaded.module"
    start = time.perf_counter()
    for _ in range(calls):
        noop(name, None)
    bare = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(calls):
        profiler._find_and_load(name, None)
    hooked = time.perf_counter() - start
    profiler.top()  # ranking is part of the cost
    return max(0.0, hooked - bare) / calls


def overhead(name: str, plain: list[float], profiled: list[float], modules: int, per_import_s: float) -> None:
    a, b = statistics.median(plain) * 1000, statistics.median(profiled) * 1000
    paired = statistics.median(y - x for x, y in zip(plain, profiled, strict=True)) * 1000
    bound = per_import_s * modules * 1000
    print(f"{name}: {len(plain)} samples per side, {modules} modules profiled per import")
    print(f"  without profiler (median): {a:9.2f} ms")
    print(f"  with profiler (median):    {b:9.2f} ms")
    print(f"  paired difference (median):{paired:+9.2f} ms = {paired / a * 100:+.1f} % (noise of a shared machine)")
    print(f"  hook cost x modules:       {bound:9.3f} ms = {bound / a * 100:.3f} % of the import")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=100, help="samples per side and architecture (check)")
    parser.add_argument("--cold-repeat", type=int, default=6, help="samples per side (cold)")
    parser.add_argument("--module", default="engine_ref.model_executor.models.llava")
    args = parser.parse_args()

    from engine_ref.isolation import add_preload_modules, ensure_warm_parent, run_isolated
    from engine_ref.model_executor.models.registry import ModelRegistry
    from pytest_enginecheck.session import CHILD_MODULES

    add_preload_modules(*CHILD_MODULES)  # as the plugin does
    ensure_warm_parent()
    run_isolated(int)  # the warm parent has finished preloading
    plain: list[float] = []
    profiled: list[float] = []
    modules = 0
    per_import_s = hook_cost_s()
    print(f"hook cost per recorded import: {per_import_s * 1e6:.2f} us")
    for entry in ModelRegistry.models.values():
        without, with_, recorded = run_isolated(import_in_child, entry.module_name, args.repeat)
        plain.extend(without)
        profiled.extend(with_)
        modules = max(modules, recorded)
    overhead(f"check (the import of each of {len(ModelRegistry.models)} bundled model modules, repeated in a warm "
             f"fork)", plain, profiled, modules, per_import_s)

    plain, profiled = [], []
    cold_modules = 0
    for i in range(args.cold_repeat):
        for flag, samples in (("0", plain), ("1", profiled))[::1 if i % 2 else -1]:
            out = subprocess.run([sys.executable, "-c", COLD, args.module, flag], check=True, capture_output=True,
                                 text=True).stdout.split()
            samples.append(float(out[0]))
            cold_modules = max(cold_modules, int(out[1]))
    overhead(f"cold (import {args.module} in a fresh interpreter)", plain, profiled, cold_modules, per_import_s)


if __name__ == "__main__":
    main()
