"""Preloaded by the warm parent for ``--enginecheck-target=vllm``: the modules ``ENGINECHECK_VLLM_PRELOAD``
names (the derived preload, see ``preload``), each imported under the CUDA guard with vLLM's log
lines and warnings kept off the terminal (the check children's own output goes to their checks).

A module that trips the guard or fails to import is dropped (removed from ``sys.modules`` with what it
pulled in), so the checks of its importers import it themselves and blame it: no verdict changes.
With ``--enginecheck-strict`` (``ENGINECHECK_VLLM_PRELOAD_STRICT=1``, set by the session that starts the
warm parent) the guard is strict: a module whose import queries ``torch.cuda.is_available()`` or
``device_count()`` is kept, and its queries are remembered (``guard.remember_preload_queries``), so the
strict import check of every architecture that imports a module of their import chains reports them
(a preloaded module is never imported again, so they would go unseen). Kept, not dropped: importing
vLLM's core modules twice fails ("... is already registered as an opaque type").
"""

from __future__ import annotations

import os

from pytest_enginecheck.registry_target import output_into
from pytest_enginecheck.targets.preloading import preload_under_guard
from pytest_enginecheck.targets.vllm import ENGINE_PACKAGES
from pytest_enginecheck.targets.vllm.describe.preload import PRELOAD_STRICT_VARIABLE, PRELOAD_VARIABLE


def preload(names: list[str], strict: bool = False) -> list[str]:
    """Import each module under the guard (strict: its queries are remembered); the names of those kept."""
    with open(os.devnull, "wb") as null, output_into(null.fileno()):
        return preload_under_guard(names, strict, ENGINE_PACKAGES)


PRELOADED = preload([n for n in os.environ.get(PRELOAD_VARIABLE, "").split(",") if n],
                    strict=os.environ.get(PRELOAD_STRICT_VARIABLE) == "1")
