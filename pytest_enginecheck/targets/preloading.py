"""What a target's warm parent preloads, imported under the CUDA guard: the one loop every target's ``warm`` module
runs (engine-agnostic; a target passes its engine's packages and keeps its own output quiet around it).

A module that trips the guard or fails to import is dropped (removed from ``sys.modules`` with what it pulled in),
so the checks of its importers import it themselves and blame it: no verdict changes. Strict: a module whose import
only queries CUDA (``torch.cuda.is_available()``, ``device_count()``) is kept and its queries remembered
(``guard.remember_preload_queries``), so the strict import check of every architecture that imports it still
reports them (a preloaded module is never imported again, so they would go unseen).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from pytest_enginecheck.guard import CudaGuard, find_holders, guarded_originals, remember_preload_queries


def preload_under_guard(names: list[str], strict: bool = False, engine_packages: tuple[str, ...] = ()) -> list[str]:
    """Import each module under the guard; the names of those kept (see the module docstring)."""
    kept = []
    for name in names:
        if name in sys.modules:
            kept.append(name)
            continue
        before = set(sys.modules)
        with CudaGuard(strict=strict, engine_packages=engine_packages) as guard:
            try:
                importlib.import_module(name)
                ok = True
            except (Exception, SystemExit):  # noqa: BLE001 - dropped, its importers' checks report it
                ok = False
        if ok and strict and guard.accesses and all(access.kind == "query" for access in guard.accesses):
            for access in guard.accesses:  # the chain from the preloaded module down (not from this one)
                access.chain = access.chain[access.chain.index(name):] if name in access.chain else access.chain
            remember_preload_queries(guard.accesses)
            kept.append(name)
        elif ok and not guard.accesses:
            kept.append(name)
        else:
            for added in set(sys.modules) - before:
                del sys.modules[added]
    find_holders(guarded_originals())  # the guard's scan of the torch modules now loaded, once for every child
    return kept


def derived_names(path: Path, module: str, timeout: float) -> list[str] | None:
    """The module names cached in ``path`` (a JSON list), else derived now by ``python -m module`` in a fresh
    interpreter (its last line of output, a JSON list) and cached there atomically; None when the derivation fails
    or times out (the target then preloads nothing: slower checks, the same verdicts)."""
    try:
        cached = json.loads(path.read_text())
        if isinstance(cached, list) and cached:
            return [str(name) for name in cached]
    except (OSError, ValueError):
        pass
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
    try:
        out = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True, text=True,
                             timeout=timeout)
        names = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        names = None
    if not isinstance(names, list) or not names:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(names))
    tmp.replace(path)
    return [str(name) for name in names]
