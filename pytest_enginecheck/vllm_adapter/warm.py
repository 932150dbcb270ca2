"""Preloaded by the warm parent for ``--enginecheck-target=vllm``: the modules ``ENGINECHECK_VLLM_PRELOAD``
names (the derived preload, see ``preload``), each imported under the CUDA guard with vLLM's log
lines and warnings kept off the terminal (the check children's own output goes to their checks).

A module that trips the guard or fails to import is dropped (removed from ``sys.modules`` with what it
pulled in), so the checks of its importers import it themselves and blame it: no verdict changes.
"""

from __future__ import annotations

import importlib
import os
import sys

from pytest_enginecheck.guard import CudaGuard, find_holders, guarded_originals
from pytest_enginecheck.vllm_adapter.env import output_into
from pytest_enginecheck.vllm_adapter.preload import PRELOAD_VARIABLE


def preload(names: list[str]) -> list[str]:
    """Import each module under the guard; the names of those kept."""
    kept = []
    with open(os.devnull, "wb") as null, output_into(null.fileno()):
        for name in names:
            before = set(sys.modules)
            with CudaGuard() as guard:
                try:
                    importlib.import_module(name)
                    ok = True
                except Exception:  # noqa: BLE001 - dropped, its importers' checks report it
                    ok = False
            if ok and not guard.accesses:
                kept.append(name)
            else:
                for added in set(sys.modules) - before:
                    del sys.modules[added]
    find_holders(guarded_originals())  # the guard's scan of the torch modules now loaded, once for every child
    return kept


PRELOADED = preload([n for n in os.environ.get(PRELOAD_VARIABLE, "").split(",") if n])
