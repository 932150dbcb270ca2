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

import os
import sys
import warnings

from pytest_enginecheck.targets.preloading import preload_under_guard
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
    saved = _quiet()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return preload_under_guard(names, strict, ENGINE_PACKAGES)
    finally:
        _loud(saved)


PRELOADED = preload([*read_preload(os.environ.get(PRELOAD_VARIABLE, "")), "pytest_enginecheck.targets.sglang.checks"],
                    strict=os.environ.get(PRELOAD_STRICT_VARIABLE) == "1")
