"""plugins: each installed general plugin of the target loads without CUDA and without error, in this warm
child under the CUDA guard and again in the process state where the engine itself first loads plugins.

One item per entry point, ``enginecheck::plugin:<name>::plugins`` (``ctx.plugin`` is the entry point's
name, ``ctx.module`` its module). The target-specific part is a loader: ``LOADERS[spec]`` names a
module exposing ``list_plugins()`` (entries with ``name``, ``value``, ``distribution``, ``module``),
``run_plugin(entry, strict)`` (an outcome with ``accesses``, ``error``, ``traceback``, loaded under the
guard), ``load_plugins(strict)`` (every allowed plugin's outcome, with the architectures it ``registered``: the
target's description) and ``run_in_engine_state(entry)`` (``(ok, output, what that state is)``).

A plugin that raises while the target is described is not an item of this check: it is a collection error
under its name (see ``targets.PluginError``), as pytest reports a test module that fails to import.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.checks.import_check import trim_chain
from pytest_enginecheck.guard import CudaAccess, CudaGuard

LOADERS = {"engine_ref": "pytest_enginecheck.checks.plugins_check", "vllm": "pytest_enginecheck.vllm_adapter.plugins"}
LABELS = {"engine_ref": "engine_ref", "vllm": "vLLM"}
ENGINE_STATE_SCRIPT = "from engine_ref.plugins import load_general_plugins; load_general_plugins()"


def loader(spec: str) -> Any:
    """The plugin loader of a target spec, or None when the target has no general plugins (a registry, a mapping)."""
    return importlib.import_module(LOADERS[spec]) if spec in LOADERS else None


def cuda_failure(what: str, access: CudaAccess, module: str) -> CheckFailure:
    """A guard verdict as the import check words it: the API, file:line, the import chain from ``module`` down."""
    access.chain = trim_chain(access, module)
    verb = "queried CUDA" if access.kind == "query" else "touched CUDA"
    return CheckFailure(f"{what} {verb}: it {access.describe()}\n{access.fix_hint}",
                        {**access.to_dict(), "kind": "cuda", "access": access.kind})


# -- engine_ref's loader ---------------------------------------------------------------------------


def list_plugins() -> list[Any]:
    """engine_ref's entry points (ENGINE_REF_PLUGINS honoured)."""
    from engine_ref import plugins

    return plugins.list_plugins()


@dataclass
class PluginOutcome:
    """What loading one plugin under the guard did."""

    entry: Any = None
    accesses: list[CudaAccess] = field(default_factory=list)
    error: BaseException | None = None
    traceback: str = ""
    location: str | None = None
    registered: tuple[str, ...] = ()  # the architectures it added to (or replaced in) the registry (load_plugins)


def run_plugin(entry: Any, strict: bool = False) -> PluginOutcome:
    """Load and call one engine_ref plugin under the guard, as ``load_general_plugins`` does."""
    from engine_ref.plugins import capture_failure
    from engine_ref.plugins import run_plugin as call

    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # is_available() without cuInit, as in production
    outcome = PluginOutcome(entry)
    with CudaGuard(strict=strict) as guard:
        try:
            call(entry)
        except BaseException as e:  # noqa: BLE001 - the plugin's failure, reported by the check
            failure = capture_failure(entry, e, skip=(__file__,))
            outcome.error, outcome.traceback, outcome.location = e, failure.traceback, failure.location
    outcome.accesses = sorted(guard.accesses, key=lambda a: a.kind != "init")
    return outcome


def load_plugins(strict: bool = False) -> list[PluginOutcome]:
    """Run every allowed plugin in entry point order, each under the guard (``run_plugin``), keeping what each one
    registered in engine_ref's ModelRegistry: how the target is described. A failing plugin does not stop the
    others, as in ``load_general_plugins`` (whose once-per-process state this leaves alone: call it once, in the
    process that describes the target)."""
    from engine_ref.model_executor.models.registry import ModelRegistry

    outcomes = []
    for entry in list_plugins():
        before = dict(ModelRegistry.models)
        outcome = run_plugin(entry, strict)
        outcome.registered = tuple(arch for arch, model in ModelRegistry.models.items()
                                   if before.get(arch) is not model)
        outcomes.append(outcome)
    return outcomes


def run_in_engine_state(entry: Any, timeout: float = 60.0) -> tuple[bool, str, str]:
    """Load only this plugin in a fresh interpreter where loading plugins is the first thing that runs: the
    state of ``engine-ref`` commands and of ``LLM(...)`` in a script (nothing of torch or engine_ref preloaded)."""
    env = {**os.environ, "ENGINE_REF_PLUGINS": entry.name,
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
    command = [sys.executable, "-c", ENGINE_STATE_SCRIPT]
    state = f"a fresh interpreter running `python -c {ENGINE_STATE_SCRIPT!r}`"
    try:
        out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"it did not finish within {timeout:g} s", state
    return out.returncode == 0, out.stderr.strip(), state


# -- the check ------------------------------------------------------------------------------------


def _entry(ctx: CheckContext, plugins: Any) -> Any:
    found = [e for e in plugins.list_plugins() if e.name == ctx.plugin and e.module == ctx.module]
    if not found:
        raise CheckFailure(f"plugin {ctx.plugin!r} ({ctx.module}) is no longer installed or allowed here",
                           {"kind": "missing_plugin"})
    return found[0]


def plugin_label(spec: str, entry: Any) -> str:
    """How a report names a plugin: ``engine_ref plugin 'oot' (pkg.plugin:register) of distribution pkg``."""
    return f"{LABELS[spec]} plugin {entry.name!r} ({entry.value}) of distribution {entry.distribution}"


def loading_failure(spec: str, entry: Any, outcome: Any) -> CheckFailure | None:
    """What loading ``entry`` under the guard did wrong (``outcome`` from the loader's ``run_plugin``): the CUDA
    access it made, else the exception it raised; None when it did neither."""
    who = plugin_label(spec, entry)
    if outcome.accesses:
        return cuda_failure(f"Loading {who}", outcome.accesses[0], entry.module)
    if outcome.error is not None:
        return CheckFailure(
            f"Loading {who} raised {type(outcome.error).__name__}: {outcome.error}"
            + (f" at {outcome.location}" if outcome.location else ""),
            {"kind": "plugin_error", "traceback": outcome.traceback})
    return None


def run(ctx: CheckContext) -> dict[str, Any]:
    plugins = loader(ctx.spec)
    entry = _entry(ctx, plugins)
    who = plugin_label(ctx.spec, entry)
    failure = loading_failure(ctx.spec, entry, plugins.run_plugin(entry, strict=ctx.strict))
    if failure is not None:
        raise failure
    ok, output, state = plugins.run_in_engine_state(entry)
    if not ok:
        root = output.strip().splitlines()[-1] if output.strip() else "(no output)"
        raise CheckFailure(f"Loading {who} works here but fails in {state}: {root}",
                           {"kind": "plugin_engine_state", "traceback": output})
    return {"entry_point": entry.value, "distribution": entry.distribution}
