"""The engine_ref target: the bundled reference engine's registry, every check.

Spec ``engine_ref`` is the global ``ModelRegistry`` with every installed general plugin
(``engine_ref.general_plugins``) loaded; a ``module:attribute`` spec names another ``ModelRegistry`` (every check)
or a mapping of architecture -> ``"module:Class"`` (the ``mapping`` kind: import and inspect, through engine_ref's
registry). The check modules are this folder's ``*_check.py``, and the core's import check (the runner runs the core's
plugins check).
"""

from __future__ import annotations

import importlib
import sys
from importlib.util import find_spec
from types import ModuleType
from typing import TYPE_CHECKING, Any

from pytest_enginecheck.checks import CHECKS
from pytest_enginecheck.registry_target import RegistryTarget
from pytest_enginecheck.targets import (
    ArchEntry,
    CheckFunction,
    Offer,
    PluginGroup,
    PluginLoader,
    TargetDescription,
    TargetError,
)

if TYPE_CHECKING:
    from pytest_enginecheck.settings import Settings

MAPPING_CHECKS = ("import", "inspect")
ENGINE_CHECKS = ("load", "budget", "startup", "lora", "quant")  # they start engines (tiny_engine.start_engine)
ESTIMATE_CHECKS = ("budget", "quant")  # they compare against engine_ref.memory.estimate
CHECK_MODULES = {
    "import": "pytest_enginecheck.checks.import_check",
    "inspect": "pytest_enginecheck.targets.engine_ref.inspect_check",
    "load": "pytest_enginecheck.targets.engine_ref.load_check",
    "budget": "pytest_enginecheck.targets.engine_ref.budget_check",
    "startup": "pytest_enginecheck.targets.engine_ref.startup_check",
    "lora": "pytest_enginecheck.targets.engine_ref.lora_check",
    "quant": "pytest_enginecheck.targets.engine_ref.quant_check",
}
MAPPING_PLUGINS = "a mapping of architecture -> 'module:Class' has no general plugins"
MAPPING_REASON = ("a mapping of architecture -> 'module:Class' has no engine to build it with; point "
                  "--enginecheck-target at an engine_ref ModelRegistry")


class EngineRefTarget(RegistryTarget):
    """engine_ref's registry (``engine_ref``, or ``module:attribute`` naming a registry or a mapping)."""

    name = "engine_ref"
    label = "engine_ref"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        # Only the global registry loads the engine's plugins; another registry or a mapping is what it names.
        self.plugin_group = PluginGroup("engine_ref.general_plugins", "ENGINE_REF_PLUGINS") if spec == self.name \
            else None

    def offered(self) -> Offer:
        return Offer(CHECKS)  # a mapping's narrower offer is known once described

    def library_packages(self) -> tuple[str, ...]:
        # engine_packages stays empty: under --enginecheck-strict the guard blames queries made while engine_ref imports
        return ("engine_ref",)

    def architectures(self, strict: bool = False) -> TargetDescription:
        """The global registry with its plugins loaded (every check), or what the spec names: another registry (every
        check) or a mapping (import and inspect)."""
        from pytest_enginecheck.targets.engine_ref.registry import resolve

        registry: Any
        if self.plugin_group:  # its plugins were loaded one at a time (describe), so each failure is named and kept
            from engine_ref.model_executor.models.registry import ModelRegistry

            kind, registry = "engine_ref", ModelRegistry
        else:
            kind, registry = resolve(self.spec)
        if kind == "engine_ref":
            entries = tuple(ArchEntry(arch, e.module_name, e.class_name) for arch, e in registry.models.items())
            offer = Offer(CHECKS)
        else:
            entries = tuple(ArchEntry(arch, *value.split(":")) for arch, value in registry.items())
            unbuilt = tuple((c, MAPPING_REASON) for c in CHECKS if c not in (*MAPPING_CHECKS, "plugins"))
            offer = Offer(MAPPING_CHECKS, (("plugins", MAPPING_PLUGINS), *unbuilt))
        return TargetDescription(self.spec, kind, entries, offer)

    def check_settings(self, settings: Settings) -> None:
        """The quant check's methods must be engine_ref's."""
        from engine_ref.model_executor.layers.quantization import QUANTIZATION_METHODS

        unknown = [m for m in settings.quant_methods if m not in QUANTIZATION_METHODS]
        if unknown:
            raise TargetError(f"--enginecheck-quant={','.join(settings.quant_methods)!r}: unknown method(s) "
                              f"{', '.join(unknown)}; choose from {','.join(QUANTIZATION_METHODS)}")

    def check_function(self, check: str) -> CheckFunction:
        """The check module's ``run``; for a check that starts engines, with what they leave behind in its verdict
        (leftovers.reported_after)."""
        module: ModuleType = importlib.import_module(CHECK_MODULES[check])
        function: CheckFunction = module.run
        if check in ENGINE_CHECKS:
            from pytest_enginecheck.targets.engine_ref.leftovers import reported_after

            return reported_after(function)
        return function

    def warm_parent_modules(self, checks: tuple[str, ...], strict: bool = False) -> tuple[str, ...]:
        """The inspect check's module (light: it imports no model); torch._dynamo (~1 s) where a check runs the
        memory estimate: its fake tensors run Python reference kernels, whose first call would import it in every
        check child; and transformers' modeling core (~2 s, dynamo with it) where load runs: its reference oracle
        loads transformers' class of each architecture (reference.py), whose module then costs a child ~0.1 s."""
        estimates = ("torch._dynamo",) if set(checks) & set(ESTIMATE_CHECKS) else ()
        references = ("transformers.modeling_utils",) if "load" in checks and find_spec("transformers") else ()
        return ("pytest_enginecheck.targets.engine_ref.inspect_check", *estimates, *references)

    def cache_counts(self) -> dict[str, int] | None:
        """engine_ref's registry's lookups in this process; None when it is not loaded (a check that never looked
        one up: importing it to ask would cost the check an import)."""
        registry = sys.modules.get("engine_ref.model_executor.models.registry")
        counts = getattr(registry, "process_cache_stats", None)
        return counts() if counts is not None else None

    def plugin_loader(self) -> PluginLoader | None:
        from pytest_enginecheck.targets.engine_ref import plugins

        return plugins if self.plugin_group else None


def target(spec: str) -> EngineRefTarget:
    """The entry point (``pytest_enginecheck.targets``: ``engine_ref``)."""
    return EngineRefTarget(spec)
