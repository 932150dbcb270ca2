"""vLLM target: import + inspect of every architecture at fork cost, next to vLLM's own subprocess
inspection of a few, in one run (run it with the Python of a venv that has vLLM).

    python benchmarks/vllm_registry.py [--limit N] [--subprocess-sample 3]

Steps: list the architectures (plugins loaded) and derive the preload in throwaway children; this
process then imports the preload under the CUDA guard and is the warm parent (children by fork);
then one warm child per architecture for ``import`` alone and one for ``import`` + ``inspect`` (the
ModelInfo built in the fork by vLLM's own function), serially;
then vLLM's own ``inspect_model_cls`` (a fresh interpreter per class, empty cache) for a sample.
Targets (issue 11, vLLM 0.33's 415 architectures, 2 cores): import <= 90 s, import + inspect <= 4 min.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any


def _describe() -> list[Any]:
    from pytest_enginecheck.targets.vllm.describe.registry import list_architectures

    return list_architectures()


def _check(entry: Any, inspect: bool) -> str:
    from pytest_enginecheck.targets.vllm.describe.registry import import_model_class, inspect_in_fork

    result = import_model_class(entry)
    if result.accesses:
        return "cuda"
    if result.error is not None or result.model_cls is None:
        return f"error: {type(result.error).__name__}"
    if inspect:
        _, accesses = inspect_in_fork(result.model_cls)
        if accesses:
            return "cuda"
    return "passed"


def _subprocess_inspect(architecture: str) -> float:
    from pytest_enginecheck.targets.vllm.describe.registry import inspect_in_subprocess

    start = time.perf_counter()
    inspect_in_subprocess(architecture)
    return time.perf_counter() - start


def _sweep(entries: list[Any], inspect: bool) -> tuple[float, dict[str, str]]:
    from engine_ref.isolation import run_isolated

    verdicts: dict[str, str] = {}
    start = time.perf_counter()
    for entry in entries:
        try:
            verdicts[entry.architecture] = run_isolated(_check, entry, inspect, timeout=300)
        except Exception as e:  # noqa: BLE001 - a crash is a verdict too
            verdicts[entry.architecture] = f"crash: {type(e).__name__}"
    return time.perf_counter() - start, verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=0, help="only the first N architectures (0: all)")
    parser.add_argument("--subprocess-sample", type=int, default=3)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="enginecheck-bench-")
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(workdir, "vllm-cache"))
    os.environ["ENGINE_REF_WORKER_MULTIPROC_METHOD"] = "fork"
    try:
        import importlib

        from engine_ref.isolation import run_isolated
        from pytest_enginecheck.guard import CudaGuard
        from pytest_enginecheck.targets.vllm.describe.preload import derive_preload

        print(f"load: {os.getloadavg()}")
        t = time.perf_counter()
        entries = run_isolated(_describe, timeout=600)
        entries = entries[:args.limit] if args.limit else entries
        describe_s = time.perf_counter() - t
        t = time.perf_counter()
        preload = run_isolated(derive_preload, timeout=600)
        preload_s = time.perf_counter() - t
        t = time.perf_counter()
        with CudaGuard() as guard:
            for name in ("pytest_enginecheck.targets.vllm.describe.registry", *preload):
                importlib.import_module(name)
        assert not guard.accesses, guard.accesses
        warm_s = time.perf_counter() - t
        import_s, import_verdicts = _sweep(entries, inspect=False)
        both_s, verdicts = _sweep(entries, inspect=True)
        lazy = [e.architecture for e in entries if e.registered_as == "lazy"]
        sample = lazy[:: max(1, len(lazy) // max(1, args.subprocess_sample))][:args.subprocess_sample]
        sub = {}
        for architecture in sample:
            try:
                sub[architecture] = run_isolated(_subprocess_inspect, architecture, timeout=600)
            except Exception as e:  # noqa: BLE001 - shown, the other samples still count
                print(f"vLLM's subprocess inspection of {architecture} failed: {e}\n{getattr(e, 'output', '')[-2000:]}")
        failed = {a: v for a, v in verdicts.items() if v != "passed"}
        n = len(entries)
        print(f"architectures: {n} (describe {describe_s:.1f} s; preload of {len(preload)} modules derived in "
              f"{preload_s:.1f} s; warm parent up in {warm_s:.1f} s)")
        print(f"import, fork per architecture:            {import_s:7.1f} s  ({import_s / n:.2f} s each)")
        print(f"import + inspect, fork per architecture:  {both_s:7.1f} s  ({both_s / n:.2f} s each)")
        mean_sub = sum(sub.values()) / max(1, len(sub))
        print(f"vLLM's own subprocess inspection:         {mean_sub:7.1f} s each over {sorted(sub)} "
              f"-> {mean_sub * n / 60:.1f} min for {n}; fork is {mean_sub / (both_s / n):.0f}x cheaper per class")
        print(f"verdicts identical between the two sweeps: {import_verdicts == verdicts}")
        print(f"not passed ({len(failed)}): {failed}")
        print(f"load: {os.getloadavg()}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
