"""The vLLM target: vLLM's registry, plugins and CPU engine, probed rather than pinned.

Four rooms, each importing only those above it in this list (``tests/test_import_cycles.py`` holds them to it):

- ``probe``, ``env``, ``failures``, ``limits``: the only door to vLLM's API, the CPU engine's environment and
  arguments, what vLLM raised (by phase and rank) and which of it is the checker's own limit.
- ``describe/``: what the target is: vLLM's general plugins, every registered architecture, the warm preload.
- ``checkpoints/``: the tiny-checkpoint factory (shrink rules, transformers' and vLLM's writers, composite,
  remote-config, tokenizer, quantized twins); it starts no engine.
- ``engine/``: vLLM's own engine on N CPU ranks (``run.run_engine``), with LoRA requests and worker RPCs as
  parameters (``drive.EngineWork``); it knows no check.
- ``checks/``: one module per check (``CHECK_FUNCTIONS``), and the steps they share (``checks.steps``).

Importing this package imports neither torch nor vLLM.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pytest_enginecheck.registry_target import RegistryTarget
from pytest_enginecheck.targets import (
    ArchEntry,
    CheckFunction,
    Offer,
    PluginGroup,
    PluginLoader,
    TargetDescription,
    TargetError,
    TargetOption,
)
from pytest_enginecheck.targets.vllm.fit.full_size import FULL_SIZE_CONFIGS

if TYPE_CHECKING:
    from pytest_enginecheck.settings import Settings

# The engine's own packages: strict mode does not blame a model for the CUDA queries made while they are imported
# (see guard.CudaGuard).
ENGINE_PACKAGES = ("vllm",)
CHECKS = ("plugins", "import", "inspect")
ENGINE_CHECKS = ("load", "budget", "startup", "lora", "quant")  # with a CPU build of vLLM
INSPECT_MODES = ("fork", "subprocess")
# --enginecheck-inspect: how the inspect check builds each ModelInfo (a check reads it as INSPECT.value(ctx.options))
INSPECT = TargetOption(
    "inspect", default="fork", choices=INSPECT_MODES,
    help="how the vLLM target's inspect check builds each ModelInfo: 'fork' runs vLLM's own function for it in the "
         "warm check process (fast), 'subprocess' vLLM's real inspection subprocess, a fresh interpreter per "
         "architecture (full fidelity, ~15 s each) (default: fork)")


class VllmTarget(RegistryTarget):
    """``--enginecheck-target=vllm``: every registry entry after vLLM's general plugins loaded."""

    name = "vllm"
    label = "vLLM"
    options = (INSPECT, FULL_SIZE_CONFIGS)  # FULL_SIZE_CONFIGS: budget[tp=N]'s full-size fit (fit/full_size.py)
    plugin_group = PluginGroup("vllm.general_plugins", "VLLM_PLUGINS")
    engine_packages = ENGINE_PACKAGES
    quiet = True  # vLLM's log lines: shown only when describing fails

    def offered(self) -> Offer:
        """The engine checks where vLLM can start its CPU engine here (decided without importing vLLM), and a note
        where the installed release is newer than the newest the checks were measured on (``window``)."""
        from pytest_enginecheck.targets.vllm import window
        from pytest_enginecheck.targets.vllm.checks.quant import NOT_OFFERED
        from pytest_enginecheck.targets.vllm.probe import cpu_backend_missing

        missing = cpu_backend_missing()
        checks = CHECKS if missing else (*CHECKS, *ENGINE_CHECKS)
        refused = [(check, missing) for check in ENGINE_CHECKS if missing]
        methods = () if missing else tuple((f"quant[{m}]", why) for m, why in NOT_OFFERED.items())
        installed = window.installed()
        notes = () if installed is None else tuple(
            note for note in (window.beyond(*installed, checks="registry"),
                              "" if missing else window.beyond(*installed, checks="engine")) if note)
        return Offer(checks, (*refused, *methods), notes)

    def check_settings(self, settings: Settings) -> None:
        """The quant check's methods must be ones the vLLM target knows (quant.METHODS, or NOT_OFFERED: skipped)."""
        from pytest_enginecheck.targets.vllm.checkpoints.quantized import METHODS
        from pytest_enginecheck.targets.vllm.checks.quant import NOT_OFFERED

        unknown = [m for m in settings.quant_methods if m not in (*METHODS, *NOT_OFFERED)]
        if unknown:
            raise TargetError(f"--enginecheck-quant={','.join(settings.quant_methods)!r}: unknown method(s) "
                              f"{', '.join(unknown)} for the vLLM target; choose from {','.join(METHODS)}")

    def architectures(self, strict: bool = False) -> TargetDescription:
        """Every entry of vLLM's registry (its general plugins loaded once, by ``describe``)."""
        from pytest_enginecheck.targets.vllm.describe.registry import list_architectures

        entries = tuple(ArchEntry(e.architecture, e.module, e.class_name) for e in list_architectures(strict=strict))
        return TargetDescription(self.spec, self.name, entries, self.offered())

    def unavailable(self) -> tuple[type[Exception], ...]:
        from pytest_enginecheck.targets.vllm.probe import VllmUnavailable

        return (VllmUnavailable,)

    def check_function(self, check: str) -> CheckFunction:
        from pytest_enginecheck.targets.vllm.checks import CHECK_FUNCTIONS

        return CHECK_FUNCTIONS[check]

    def plugin_loader(self) -> PluginLoader:
        from pytest_enginecheck.targets.vllm.describe import plugins

        return plugins

    def prepare_children(self, workdir: str) -> None:
        from pytest_enginecheck.targets.vllm.env import redirect_caches

        redirect_caches(workdir)

    def warm_parent_modules(self, checks: tuple[str, ...], strict: bool = False) -> tuple[str, ...]:
        """``warm``, which imports the preload derived from the target (``preload``, cached on disk) under the guard
        (strict with ``--enginecheck-strict``), and vLLM's ``LLM`` when an engine check runs; then ``engine.warm``,
        which compiles vLLM's small compiled helpers for the ranks."""
        from pytest_enginecheck.targets.vllm.describe.preload import (
            PRELOAD_STRICT_VARIABLE,
            PRELOAD_VARIABLE,
            preload_modules,
        )

        os.environ[PRELOAD_STRICT_VARIABLE] = "1" if strict else "0"
        names = preload_modules()
        engine = bool(set(checks) & set(ENGINE_CHECKS))
        if engine:
            names.append("vllm.entrypoints.llm")
        os.environ[PRELOAD_VARIABLE] = ",".join([*names, "pytest_enginecheck.targets.vllm.checks"])
        return ("pytest_enginecheck.targets.vllm.describe.warm",
                *(("pytest_enginecheck.targets.vllm.engine.warm",) if engine else ()))


def target(spec: str) -> VllmTarget:
    """The entry point (``pytest_enginecheck.targets``: ``vllm``)."""
    return VllmTarget(spec)
