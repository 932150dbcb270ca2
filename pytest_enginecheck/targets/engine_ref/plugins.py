"""engine_ref's general plugins (entry-point group ``engine_ref.general_plugins``), loaded one entry point at a time
under the CUDA guard, as ``engine_ref.plugins.load_general_plugins`` loads them: the target's ``PluginLoader``."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from pytest_enginecheck.guard import CudaGuard
from pytest_enginecheck.targets import PluginOutcome

ENGINE_STATE_SCRIPT = "from engine_ref.plugins import load_general_plugins; load_general_plugins()"



def list_plugins() -> list[Any]:
    """engine_ref's entry points (ENGINE_REF_PLUGINS honoured)."""
    from engine_ref import plugins

    return plugins.list_plugins()


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


