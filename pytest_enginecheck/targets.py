"""Targets: the engines pytest-enginecheck can check, behind one small adapter.

- ``engine_ref``: the bundled zoo (engine_ref's ModelRegistry); every check applies.
- ``module:attribute``: an engine_ref ``ModelRegistry`` (every check applies), or a mapping of
  architecture -> ``"module:Class"`` (the string form of vLLM's register_model; import and inspect).
- ``vllm``: vLLM's real registry (import and inspect through vLLM's own ``inspect_model_cls``).

A target is resolved *inside* check processes, never in the pytest process: resolving it may
import the engine (torch, vLLM), and the pytest process stays light.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_enginecheck.checks import CHECKS

MAPPING_CHECKS = ("import", "inspect")
# The engine core a target's model modules all import: preloaded once in the warm parent, like
# torch, so each check imports only the model module itself (vLLM: ~9 s once instead of per check).
TARGET_PRELOAD = {
    "vllm": ("vllm.model_executor.models.registry", "vllm.model_executor.models.utils",
             "vllm.model_executor.layers.linear"),
}


class TargetError(Exception):
    """The target spec cannot be resolved; the message says what to pass instead."""


@dataclass(frozen=True)
class ArchEntry:
    """Where an architecture's class lives."""

    architecture: str
    module: str
    class_name: str


@dataclass(frozen=True)
class TargetDescription:
    """What the pytest process needs to generate items: the archs and the checks that apply."""

    spec: str
    kind: str  # "engine_ref" | "mapping" | "vllm"
    entries: tuple[ArchEntry, ...]
    checks: tuple[str, ...]
    plugins: tuple[tuple[str, str, str], ...] = ()  # the target's general plugins: (name, value, distribution)


def _split(spec: str) -> tuple[str, str]:
    module, sep, attribute = spec.partition(":")
    if not sep or not module or not attribute:
        raise TargetError(
            f"--enginecheck-target={spec!r} is not a target: use 'engine_ref', 'vllm', or 'module:attribute' "
            f"naming a mapping of architecture -> 'module:Class' or an engine_ref ModelRegistry."
        )
    return module, attribute


def resolve(spec: str) -> tuple[str, Any]:
    """(kind, object): the engine_ref registry, the mapping, or vLLM's registry the spec names."""
    if spec == "engine_ref":
        from engine_ref.model_executor.models.registry import ModelRegistry
        from engine_ref.plugins import load_general_plugins

        load_general_plugins(raise_on_failure=False)  # a failing plugin is the plugins check's to report
        return "engine_ref", ModelRegistry
    if spec == "vllm":
        try:
            from vllm.model_executor.models.registry import ModelRegistry as VllmRegistry
        except ImportError as e:
            raise TargetError(f"--enginecheck-target=vllm needs vLLM installed ({e}); pip install vllm.") from None
        return "vllm", VllmRegistry
    module_name, attribute = _split(spec)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TargetError(
            f"--enginecheck-target={spec!r}: cannot import {module_name!r} ({e}). Is it on sys.path? Install it, "
            f"or add its directory to pytest's `pythonpath` ini option."
        ) from None
    try:
        obj = getattr(module, attribute)
    except AttributeError:
        raise TargetError(f"--enginecheck-target={spec!r}: module {module_name!r} has no {attribute!r}") from None
    from engine_ref.model_executor.models.registry import _ModelRegistry

    if isinstance(obj, _ModelRegistry):
        return "engine_ref", obj
    if isinstance(obj, Mapping):
        bad = {k: v for k, v in obj.items() if not isinstance(v, str) or v.count(":") != 1}
        if bad:
            raise TargetError(
                f"--enginecheck-target={spec!r}: values must be 'module:Class' strings; bad entries: {bad}")
        return "mapping", obj
    raise TargetError(
        f"--enginecheck-target={spec!r} names a {type(obj).__name__}; it must be a mapping of "
        f"architecture -> 'module:Class' or an engine_ref ModelRegistry."
    )


def describe(spec: str) -> TargetDescription:
    """Resolve the spec (run this in a check process) and list its architectures."""
    kind, obj = resolve(spec)
    if kind == "engine_ref":
        entries = tuple(ArchEntry(arch, e.module_name, e.class_name) for arch, e in obj.models.items())
        checks = CHECKS
    elif kind == "vllm":
        entries = tuple(ArchEntry(arch, m.module_name, m.class_name) for arch, m in obj.models.items()
                        if hasattr(m, "module_name"))
        checks = (*MAPPING_CHECKS, "plugins")
    else:
        entries = tuple(ArchEntry(arch, *value.split(":")) for arch, value in obj.items())
        checks = MAPPING_CHECKS
    from pytest_enginecheck.checks.plugins_check import loader

    plugins = loader(spec)
    listed = tuple((e.name, e.value, e.distribution) for e in plugins.list_plugins()) if plugins else ()
    return TargetDescription(spec, kind, entries, checks, listed)


def engine_ref_registry(spec: str) -> Any:
    """The engine_ref registry a spec names, with its entries also in the global ModelRegistry.

    Engines resolve architectures through the global registry, so a target registry's
    registrations are copied there (in the check process only: call it once per process).
    """
    return into_global_registry(*resolve(spec))


def into_global_registry(kind: str, registry: Any) -> Any:
    """engine_ref's global ModelRegistry, holding the entries of a resolved engine_ref or mapping target."""
    from engine_ref.model_executor.models.registry import ModelRegistry, RegisteredModel

    if kind == "mapping":
        ModelRegistry.models.update({arch: RegisteredModel.parse(value) for arch, value in registry.items()})
    elif registry is not ModelRegistry:
        ModelRegistry.models.update(registry.models)
    return ModelRegistry
