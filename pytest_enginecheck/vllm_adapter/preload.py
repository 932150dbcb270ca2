"""The modules to preload in the warm parent for the vLLM target, found from the target itself.

In a check child, a sample of the registry's model modules is imported under the CUDA guard; every
vLLM module a model module refers to directly (a module or an object defined in it, in the model
module's globals) is counted. Those that at least ``share`` of the sample use are the preload,
after each is imported once more under the guard: one that trips it or fails is dropped, and is
left for the checks of its importers to blame. Nothing here is a hand-kept list.
"""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from types import ModuleType

from pytest_enginecheck.guard import CudaGuard
from pytest_enginecheck.vllm_adapter.registry import list_architectures


def _direct_vllm_imports(module: ModuleType, exclude: set[str]) -> set[str]:
    names = set()
    for value in vars(module).values():
        name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str) and name.startswith("vllm.") and name not in exclude and name in sys.modules:
            names.add(name)
    return names


def _guard_clean(name: str) -> bool:
    with CudaGuard() as guard:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a failing module is not preloaded
            return False
    return not guard.accesses


def derive_preload(sample_size: int = 40, share: float = 0.3) -> list[str]:
    """Run in a throwaway child: the vLLM modules at least ``share`` of a sample of model modules import."""
    modules = sorted({e.module for e in list_architectures() if e.registered_as == "lazy"})
    step = max(1, len(modules) // sample_size)
    sample = modules[::step][:sample_size]
    counts: Counter[str] = Counter()
    imported = 0
    for name in sample:
        with CudaGuard() as guard:
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - its own check reports it
                continue
        if guard.accesses:
            continue
        imported += 1
        counts.update(_direct_vllm_imports(module, set(modules)))
    shared = sorted(name for name, n in counts.items() if n >= share * max(imported, 1))
    return [name for name in shared if _guard_clean(name)]


def cache_key() -> str:
    """The installed vLLM's version and registry source: the preload is derived again when either changes."""
    import hashlib

    from pytest_enginecheck.vllm_adapter.probe import probe

    api = probe()
    source = open(api.registry_module.__file__, "rb").read()  # noqa: SIM115 - read once
    return f"{api.version}-{hashlib.sha256(source).hexdigest()[:16]}"
