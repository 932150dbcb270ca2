"""Marginal cost of one more architecture in the import check, against a fresh interpreter each.

Both sides import the same model modules of the bundled zoo, measured side by side in one run:
- enginecheck: ``run_check`` of the import check (a fork of the warm parent, guard on, import);
- fresh: ``python -c "import torch; import <module>"`` per architecture, the naive alternative.

    python benchmarks/import_check.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from engine_ref.isolation import add_preload_modules, ensure_warm_parent, run_isolated
    from engine_ref.model_executor.models.registry import ModelRegistry
    from pytest_enginecheck.checks import CheckContext
    from pytest_enginecheck.checks.runner import run_check
    from pytest_enginecheck.session import CHILD_MODULES

    entries = list(ModelRegistry.models.items())
    add_preload_modules(*CHILD_MODULES)  # as the plugin does
    ensure_warm_parent()
    run_isolated(int)  # the warm parent has finished preloading
    ours, fresh = [], []
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(args.repeat):
            for arch, entry in entries:
                ctx = CheckContext("import", "engine_ref", arch, entry.module_name, entry.class_name, workdir)
                start = time.perf_counter()
                result = run_check(ctx)
                ours.append(time.perf_counter() - start)
                assert result.outcome == "passed", result.message
                start = time.perf_counter()
                subprocess.run([sys.executable, "-c", f"import torch, {entry.module_name}"], check=True)
                fresh.append(time.perf_counter() - start)
    ours_ms, fresh_ms = statistics.median(ours) * 1000, statistics.median(fresh) * 1000
    print(f"architectures: {len(entries)}, repeats: {args.repeat}, samples per side: {len(ours)}")
    print(f"enginecheck import check, per architecture (median): {ours_ms:8.1f} ms")
    print(f"fresh interpreter per architecture (median):         {fresh_ms:8.1f} ms")
    print(f"ratio fresh / enginecheck:                           {fresh_ms / ours_ms:8.1f}x")


if __name__ == "__main__":
    main()
