"""The engine_ref target's specs resolved to a registry: ``engine_ref`` is engine_ref's global ``ModelRegistry``
with its general plugins loaded; ``module:attribute`` names another ``ModelRegistry``, or a mapping of
architecture -> ``"module:Class"`` (the string form of vLLM's register_model), checked through engine_ref's.

Resolved in check processes only: resolving imports torch and engine_ref.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from pytest_enginecheck.targets import TargetError, usage


def split(spec: str) -> tuple[str, str]:
    """``module:attribute`` -> (module, attribute), or a TargetError saying what a spec is."""
    module, sep, attribute = spec.partition(":")
    if not sep or not module or not attribute:
        raise TargetError(f"--enginecheck-target={spec!r} is not a target: {usage()}.")
    return module, attribute


def resolve(spec: str) -> tuple[str, Any]:
    """(kind, object): ``("engine_ref", registry)`` or ``("mapping", mapping)``."""
    if spec == "engine_ref":
        from engine_ref.model_executor.models.registry import ModelRegistry
        from engine_ref.plugins import load_general_plugins

        load_general_plugins(raise_on_failure=False)  # a failing plugin was reported when the target was described
        return "engine_ref", ModelRegistry
    module_name, attribute = split(spec)
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
