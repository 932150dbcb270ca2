"""Targets: the engines pytest-enginecheck can check, behind one small adapter.

- ``engine_ref``: the bundled zoo (engine_ref's ModelRegistry); every check applies.
- ``module:attribute``: an engine_ref ``ModelRegistry`` (every check applies), or a mapping of
  architecture -> ``"module:Class"`` (the string form of vLLM's register_model; import and inspect).
- ``vllm``: vLLM's real registry with its general plugins loaded (``vllm_adapter``): import, inspect and
  plugins; load, budget and startup too where the installed vLLM is a CPU build.

A target is resolved *inside* check processes, never in the pytest process: resolving it may
import the engine (torch, vLLM), and the pytest process stays light.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_enginecheck.checks import CHECKS

MAPPING_CHECKS = ("import", "inspect")
VLLM_CHECKS = ("plugins", "import", "inspect")
VLLM_ENGINE_CHECKS = ("load", "budget", "startup")  # with a CPU build of vLLM


class TargetError(Exception):
    """The target spec cannot be resolved; the message says what to pass instead."""


@dataclass(frozen=True)
class ArchEntry:
    """Where an architecture's class lives."""

    architecture: str
    module: str
    class_name: str


@dataclass(frozen=True)
class PluginError:
    """A general plugin that raised while the target was described (its loading, under the guard, as the engine
    loads it). The session reports it as a collection error under ``plugin:<name>``, whatever checks are selected,
    and the architectures it registered before it raised are not checked: they come from a plugin that failed."""

    name: str
    value: str  # "module:function"
    distribution: str
    message: str  # what it raised (or the CUDA it touched) and where, as the plugins check words it
    traceback: str
    lost: tuple[str, ...]  # the architectures it registered before it raised

    def lost_words(self) -> str:
        """Which architectures the failure took with it, as far as they can be known."""
        if self.lost:
            return f"not checked: {', '.join(self.lost)} (registered by it before it raised)"
        return "it registered no architecture before it raised: which ones it would have registered cannot be known"


@dataclass(frozen=True)
class TargetDescription:
    """What the pytest process needs to generate items: the archs and the checks that apply."""

    spec: str
    kind: str  # "engine_ref" | "mapping" | "vllm"
    entries: tuple[ArchEntry, ...]
    checks: tuple[str, ...]
    plugins: tuple[tuple[str, str, str], ...] = ()  # the target's general plugins: (name, value, distribution)
    missing: str = ""  # why some of the target's checks are not offered here ('' when none is missing)
    plugin_errors: tuple[PluginError, ...] = ()  # the plugins that raised while it was described


def _split(spec: str) -> tuple[str, str]:
    module, sep, attribute = spec.partition(":")
    if not sep or not module or not attribute:
        raise TargetError(
            f"--enginecheck-target={spec!r} is not a target: use 'engine_ref', 'vllm', or 'module:attribute' "
            f"naming a mapping of architecture -> 'module:Class' or an engine_ref ModelRegistry."
        )
    return module, attribute


def resolve(spec: str) -> tuple[str, Any]:
    """(kind, object): the engine_ref registry or the mapping the spec names (vLLM: see ``describe``)."""
    if spec == "engine_ref":
        from engine_ref.model_executor.models.registry import ModelRegistry
        from engine_ref.plugins import load_general_plugins

        load_general_plugins(raise_on_failure=False)  # a failing plugin was reported when the target was described
        return "engine_ref", ModelRegistry
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


def vllm_checks() -> tuple[tuple[str, ...], str]:
    """The checks the vLLM target offers here and, when the engine checks are not among them, why (in one
    sentence that says what to do). Decided without importing vLLM, so a usage error comes at once."""
    from pytest_enginecheck.vllm_adapter.probe import cpu_backend_missing

    missing = cpu_backend_missing()
    return (VLLM_CHECKS, missing) if missing else ((*VLLM_CHECKS, *VLLM_ENGINE_CHECKS), "")


def warm_parent_modules(spec: str, checks: tuple[str, ...], strict: bool = False) -> tuple[str, ...]:
    """What the warm parent preloads for the target's selected checks (call before the first check child).

    vLLM: ``vllm_adapter.warm``, which imports the preload derived from the target (``vllm_adapter.preload``,
    cached on disk) under the guard (strict with ``--enginecheck-strict``), and vLLM's ``LLM`` when an engine
    check runs.
    """
    if spec != "vllm":
        return ()
    from pytest_enginecheck.vllm_adapter.preload import PRELOAD_STRICT_VARIABLE, PRELOAD_VARIABLE, preload_modules

    os.environ[PRELOAD_STRICT_VARIABLE] = "1" if strict else "0"

    names = preload_modules()
    if set(checks) & set(VLLM_ENGINE_CHECKS):
        names.append("vllm.entrypoints.llm")
    os.environ[PRELOAD_VARIABLE] = ",".join([*names, "pytest_enginecheck.vllm_adapter.checks"])
    return ("pytest_enginecheck.vllm_adapter.warm",)


def plugin_errors(spec: str, outcomes: list[Any]) -> tuple[PluginError, ...]:
    """The plugins among ``outcomes`` (the loader's ``load_plugins``) that raised."""
    from pytest_enginecheck.checks.plugins_check import loading_failure

    errors = []
    for outcome in outcomes:
        failure = loading_failure(spec, outcome.entry, outcome) if outcome.error is not None else None
        if failure is not None:
            entry = outcome.entry
            errors.append(PluginError(entry.name, entry.value, entry.distribution, failure.message, outcome.traceback,
                                      outcome.registered))
    return tuple(errors)


def _without(entries: tuple[ArchEntry, ...], plugins: tuple[tuple[str, str, str], ...],
             errors: tuple[PluginError, ...]) -> tuple[tuple[ArchEntry, ...], tuple[tuple[str, str, str], ...]]:
    """The entries and plugins left to check: a failed plugin is a collection error, not an item, and so are the
    architectures it registered before it raised."""
    lost = {arch for error in errors for arch in error.lost}
    failed = {error.name for error in errors}
    return (tuple(e for e in entries if e.architecture not in lost),
            tuple(p for p in plugins if p[0] not in failed))


def _describe_vllm(strict: bool) -> TargetDescription:
    from pytest_enginecheck.vllm_adapter.env import output_into
    from pytest_enginecheck.vllm_adapter.plugins import list_plugins, load_plugins
    from pytest_enginecheck.vllm_adapter.probe import VllmUnavailable
    from pytest_enginecheck.vllm_adapter.registry import list_architectures

    with tempfile.TemporaryFile() as log:  # vLLM's log lines: shown only when describing fails
        try:
            with output_into(log.fileno()):
                found, plugins = list_architectures(strict=strict), list_plugins()
                errors = plugin_errors("vllm", load_plugins(strict=strict))  # loaded once, by list_architectures
        except VllmUnavailable as e:
            raise TargetError(f"--enginecheck-target=vllm: {e}") from None
        except Exception as e:  # noqa: BLE001 - told with what vLLM printed
            log.seek(0)
            printed = log.read().decode(errors="replace").strip()[-4000:]
            raise TargetError(f"--enginecheck-target=vllm could not be loaded: {type(e).__name__}: {e}"
                              + (f"\nIts output:\n{printed}" if printed else "")) from None
    checks, missing = vllm_checks()
    entries, listed = _without(tuple(ArchEntry(e.architecture, e.module, e.class_name) for e in found),
                               tuple((p.name, p.value, p.distribution) for p in plugins), errors)
    return TargetDescription("vllm", "vllm", entries, checks, listed, missing, errors)


def describe(spec: str, strict: bool = False) -> TargetDescription:
    """Resolve the spec (run this in a check process) and list its architectures.

    A general plugin that raises is kept in ``plugin_errors`` (the run reports it as a collection error), and
    the architectures it registered before it raised are left out of ``entries``.

    vLLM: every registry entry after vLLM's general plugins loaded (each under the guard, honouring
    VLLM_PLUGINS), class-registered ones included.
    """
    if spec == "vllm":
        return _describe_vllm(strict)
    from pytest_enginecheck.checks.plugins_check import load_plugins, loader

    errors: tuple[PluginError, ...] = ()
    obj: Any
    if spec == "engine_ref":  # its plugins one at a time under the guard, so each failure is named and kept
        from engine_ref.model_executor.models.registry import ModelRegistry

        kind, obj = "engine_ref", ModelRegistry
        errors = plugin_errors(spec, load_plugins(strict))
    else:
        kind, obj = resolve(spec)
    checks: tuple[str, ...]
    if kind == "engine_ref":
        entries = tuple(ArchEntry(arch, e.module_name, e.class_name) for arch, e in obj.models.items())
        checks = CHECKS
    else:
        entries = tuple(ArchEntry(arch, *value.split(":")) for arch, value in obj.items())
        checks = MAPPING_CHECKS
    plugins = loader(spec)
    listed = tuple((e.name, e.value, e.distribution) for e in plugins.list_plugins()) if plugins else ()
    entries, listed = _without(entries, listed, errors)
    return TargetDescription(spec, kind, entries, checks, listed, plugin_errors=errors)


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
