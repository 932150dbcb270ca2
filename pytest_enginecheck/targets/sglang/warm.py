"""Preloaded by the warm parent for ``--enginecheck-target=sglang``: the modules of the file
``ENGINECHECK_SGLANG_PRELOAD`` names (see ``preload``), then this target's check functions, each imported under
the CUDA guard with SGLang's log lines and warnings kept off the terminal.

A module that trips the guard or fails to import is dropped (removed from ``sys.modules`` with what it pulled
in), so the checks of the model modules that import it import it themselves and blame it: no verdict changes.
Strict (``ENGINECHECK_SGLANG_PRELOAD_STRICT=1``): a module whose import only queries CUDA is kept and its
queries remembered (``guard.remember_preload_queries``), so the strict import check of every model module
that imports it still reports them.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

from pytest_enginecheck.guard import CudaGuard, find_holders, guarded_originals, remember_preload_queries
from pytest_enginecheck.targets.sglang import ENGINE_PACKAGES
from pytest_enginecheck.targets.sglang.preload import PRELOAD_STRICT_VARIABLE, PRELOAD_VARIABLE, read_preload


def _quiet() -> tuple[int, int]:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    return saved


def _loud(saved: tuple[int, int]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, copy in zip((1, 2), saved, strict=True):
        os.dup2(copy, fd)
        os.close(copy)


def preload(names: list[str], strict: bool = False) -> list[str]:
    """Import each module under the guard (strict: its queries remembered); the names of those kept."""
    kept = []
    saved = _quiet()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in names:
                if name in sys.modules:
                    kept.append(name)
                    continue
                before = set(sys.modules)
                with CudaGuard(strict=strict, engine_packages=ENGINE_PACKAGES) as guard:
                    try:
                        importlib.import_module(name)
                        ok = True
                    except BaseException:  # noqa: BLE001 - dropped, its importers' checks report it
                        ok = False
                if ok and strict and guard.accesses and all(a.kind == "query" for a in guard.accesses):
                    for access in guard.accesses:  # the chain from the preloaded module down
                        access.chain = access.chain[access.chain.index(name):] if name in access.chain \
                            else access.chain
                    remember_preload_queries(guard.accesses)
                    kept.append(name)
                elif ok and not guard.accesses:
                    kept.append(name)
                else:
                    for added in set(sys.modules) - before:
                        del sys.modules[added]
    finally:
        _loud(saved)
    find_holders(guarded_originals())  # the guard's scan of the torch modules now loaded, once for every child
    return kept


PRELOADED = preload([*read_preload(os.environ.get(PRELOAD_VARIABLE, "")), "pytest_enginecheck.targets.sglang.checks"],
                    strict=os.environ.get(PRELOAD_STRICT_VARIABLE) == "1")
