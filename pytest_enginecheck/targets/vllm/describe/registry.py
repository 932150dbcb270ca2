"""vLLM's registry as the checks see it: every architecture (in tree, out of tree, registered as a
string or as a class), each imported and inspected with the CUDA guard on.

``describe`` runs in a check process: it loads the general plugins first (see ``plugins``), so
out-of-tree architectures are listed like in-tree ones. A class-registered entry has already been
imported by its plugin; its module is the class's module.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

from pytest_enginecheck.guard import CudaAccess, CudaGuard
from pytest_enginecheck.targets.vllm import ENGINE_PACKAGES
from pytest_enginecheck.targets.vllm.describe.plugins import load_plugins
from pytest_enginecheck.targets.vllm.probe import probe


@dataclass(frozen=True)
class VllmArch:
    """One registry entry: where its class lives and how it was registered ("lazy" or "class")."""

    architecture: str
    module: str
    class_name: str
    registered_as: str


def _entry(architecture: str, registered: Any) -> VllmArch:
    if hasattr(registered, "module_name") and hasattr(registered, "class_name"):
        return VllmArch(architecture, registered.module_name, registered.class_name, "lazy")
    model_cls = getattr(registered, "model_cls", None)
    if isinstance(model_cls, type):
        return VllmArch(architecture, model_cls.__module__, model_cls.__qualname__, "class")
    raise TypeError(f"vLLM registry entry {architecture!r} is a {type(registered).__name__} with neither "
                    f"module_name/class_name nor model_cls; the adapter does not know this kind of entry")


def list_architectures(strict: bool = False) -> list[VllmArch]:
    """Every architecture of vLLM's registry after the general plugins loaded, sorted by name."""
    load_plugins(strict=strict)
    models = probe().registry.models
    return [_entry(arch, models[arch]) for arch in sorted(models)]


@dataclass
class ModelImport:
    """What importing one architecture's module and looking its class up did, under the guard."""

    model_cls: type | None
    accesses: list[CudaAccess]
    error: BaseException | None


def import_model_class(entry: VllmArch, strict: bool = False) -> ModelImport:
    """Import the entry's module and look its class up, both with the guard on (some vLLM packages,
    e.g. ``vllm.models.inkling``, import their real model code in a module ``__getattr__``)."""
    model_cls, error = None, None
    with CudaGuard(strict=strict, engine_packages=ENGINE_PACKAGES) as guard:
        try:
            if entry.registered_as == "class":
                model_cls = probe().registry.models[entry.architecture].model_cls
            else:
                model_cls = getattr(importlib.import_module(entry.module), entry.class_name)
        except BaseException as e:  # noqa: BLE001 - classified by the caller
            error = e
    return ModelImport(model_cls, sorted(guard.accesses, key=lambda a: a.kind != "init"), error)


def _as_dict(info: Any) -> dict[str, Any]:
    return asdict(info) if is_dataclass(info) and not isinstance(info, type) else dict(vars(info))


def inspect_in_fork(model_cls: type, strict: bool = False) -> tuple[dict[str, Any], list[CudaAccess]]:
    """The ModelInfo vLLM's inspection subprocess would build, built here (the warm fork) under the guard."""
    with CudaGuard(strict=strict, engine_packages=ENGINE_PACKAGES) as guard:
        info = probe().model_info_from_cls(model_cls)
    return _as_dict(info), sorted(guard.accesses, key=lambda a: a.kind != "init")


class InspectionError(Exception):
    """vLLM's own inspection failed; ``cause`` is its root exception line, ``output`` its full text."""

    def __init__(self, cause: str, output: str) -> None:
        super().__init__(cause)
        self.cause = cause
        self.output = output


def root_line(text: str) -> str:
    """The last ``Type: message`` line of a traceback text (the root exception)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    exception_lines = [line for line in lines if not line.startswith(("File ", "^", "~")) and ":" in line
                       and line.split(":", 1)[0].replace(".", "").replace("_", "").isalnum()]
    return exception_lines[-1] if exception_lines else (lines[-1] if lines else "")


def inspect_in_subprocess(architecture: str) -> dict[str, Any]:
    """vLLM's own path: the registry entry's ``inspect_model_cls`` (its cache, then its fresh interpreter)."""
    from contextlib import nullcontext

    from pytest_enginecheck.cache_observer import observe_cache_file

    registered = probe().registry.models[architecture]
    cache_dir = getattr(registered, "_get_cache_dir", None)  # vLLM's _LazyRegisteredModel: its modelinfos file
    cache_name = getattr(registered, "_get_cache_filename", None)
    observed = observe_cache_file(cache_dir() / cache_name()) if cache_dir and cache_name else nullcontext()
    try:
        with observed as seen:
            info = registered.inspect_model_cls()
    except Exception as e:  # noqa: BLE001 - vLLM's error text is the report
        text = str(e)
        raise InspectionError(root_line(text) or f"{type(e).__name__}: {text}", text) from None
    return {**_as_dict(info), "cache": seen.counts() if seen is not None else
            f"this vLLM's registry entry ({type(registered).__name__}) names no modelinfos file"}
