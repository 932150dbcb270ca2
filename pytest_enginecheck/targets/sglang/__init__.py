"""The SGLang target: every model module of SGLang's own package and of its out-of-tree package.

- ``discovery``: the modules SGLang's registry scans (``sglang.srt.models``, and the package
  ``SGLANG_EXTERNAL_MODEL_PACKAGE`` names), each one's ``EntryClass`` read from its source: describing
  the target imports no model.
- ``checks``: import (each module in its own warm fork under the CUDA guard, never through SGLang's
  lenient scan, which drops a failing module with a warning) and inspect (``requirements``: what SGLang's
  registry, loader and runner need of the class).
- ``plugins``: the out-of-tree package, checked as SGLang loads it (the target's PluginLoader).
- ``env``: the children's environment (an empty external package, so importing SGLang's registry scans
  nothing; caches into the session's directory); ``preload`` / ``warm``: what the model modules share,
  derived from them and preloaded in the warm parent.

Importing this package imports neither torch nor SGLang.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pytest_enginecheck.registry_target import RegistryTarget
from pytest_enginecheck.targets import ArchEntry, CheckFunction, Offer, PluginLoader, TargetDescription

if TYPE_CHECKING:
    from pytest_enginecheck.targets.sglang.discovery import ModelModule

ENGINE_PACKAGES = ("sglang",)
CHECKS = ("plugins", "import", "inspect")
NO_CPU_ENGINE = ("SGLang has no CPU build on the package index (its CPU backend is a source build for Xeon AMX "
                 "CPUs), so its engine cannot start here")
REFUSED = (
    ("load", NO_CPU_ENGINE),
    ("budget", NO_CPU_ENGINE),
    ("startup", NO_CPU_ENGINE),
    ("lora", "not implemented for the SGLang target: it runs on engine_ref targets"),
    ("quant", "not implemented for the SGLang target: it runs on engine_ref targets"),
)


def architecture_entries(modules_by_package: list[list[ModelModule]]) -> tuple[ArchEntry, ...]:
    """The architectures of the packages' modules (``discovery.ModelModule``), later packages replacing earlier
    ones by name, as SGLang's registry lets the out-of-tree package replace in-tree classes. A module whose
    ``EntryClass`` its source does not spell out stands for itself (``<module>.EntryClass``)."""
    from pytest_enginecheck.targets.sglang.discovery import ENTRY_CLASS

    entries: dict[str, ArchEntry] = {}
    for modules in modules_by_package:
        for module in modules:
            if module.opaque:
                entries[f"{module.name}.{ENTRY_CLASS}"] = ArchEntry(f"{module.name}.{ENTRY_CLASS}", module.name,
                                                                     ENTRY_CLASS)
            for architecture, name in module.classes:
                entries.pop(architecture, None)
                entries[architecture] = ArchEntry(architecture, module.name, name)
    return tuple(entries.values())


class SglangTarget(RegistryTarget):
    """``--enginecheck-target=sglang``: SGLang's model package, and the out-of-tree one it is told to load."""

    name = "sglang"
    label = "SGLang"
    engine_packages = ENGINE_PACKAGES

    def offered(self) -> Offer:
        return Offer(CHECKS, REFUSED)

    def architectures(self, strict: bool = False) -> TargetDescription:
        """The modules of SGLang's own package and of the out-of-tree one, found from their sources."""
        from pytest_enginecheck.targets.sglang.discovery import IN_TREE_PACKAGE, discover
        from pytest_enginecheck.targets.sglang.env import external_package

        package = external_package()
        found = [discover(IN_TREE_PACKAGE)]
        if package:
            found.append(discover(package))
        return TargetDescription(self.spec, self.name, architecture_entries(found), self.offered())

    def unavailable(self) -> tuple[type[Exception], ...]:
        from pytest_enginecheck.targets.sglang.discovery import DiscoveryError

        return (DiscoveryError,)

    def check_function(self, check: str) -> CheckFunction:
        from pytest_enginecheck.targets.sglang.checks import CHECK_FUNCTIONS

        return CHECK_FUNCTIONS[check]

    def plugin_loader(self) -> PluginLoader:
        from pytest_enginecheck.targets.sglang import plugins

        return plugins

    def plugin_count(self) -> int:
        """1 when ``SGLANG_EXTERNAL_MODEL_PACKAGE`` names a package (SGLang loads one), else 0."""
        from pytest_enginecheck.targets.sglang.env import external_package

        return 1 if external_package() else 0

    def prepare_children(self, workdir: str) -> None:
        from pytest_enginecheck.targets.sglang.env import prepare_environment

        prepare_environment(workdir)

    def warm_parent_modules(self, checks: tuple[str, ...], strict: bool = False) -> tuple[str, ...]:
        """``warm``, which imports the preload derived from SGLang's model modules (``preload``, cached on disk)
        under the guard, when import or inspect runs; the check functions' module in any case."""
        from pytest_enginecheck.targets.sglang.preload import PRELOAD_STRICT_VARIABLE, PRELOAD_VARIABLE, preload_file

        path = preload_file() if {"import", "inspect"} & set(checks) else None
        os.environ[PRELOAD_STRICT_VARIABLE] = "1" if strict else "0"
        os.environ[PRELOAD_VARIABLE] = path or ""
        return ("pytest_enginecheck.targets.sglang.warm",)


def target(spec: str) -> SglangTarget:
    """The entry point (``pytest_enginecheck.targets``: ``sglang``)."""
    return SglangTarget(spec)
