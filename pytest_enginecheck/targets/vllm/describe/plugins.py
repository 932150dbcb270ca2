"""vLLM's general plugins (entry-point group ``vllm.general_plugins``), loaded as vLLM loads them,
one entry point at a time under the CUDA guard so each failure is blamed on its own plugin.

Discovery and the ``VLLM_PLUGINS`` filter are vLLM's own (``vllm.plugins.load_plugins_by_group``
where the installed vLLM has it). A plugin is also checked in the state of vLLM's inspection
subprocess: a fresh interpreter entering through ``python -m vllm.model_executor.models.registry``,
where plugins run before anything else (the state in which public plugin failures happen).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from pytest_enginecheck.guard import CudaGuard
from pytest_enginecheck.targets import PluginOutcome
from pytest_enginecheck.targets.vllm import ENGINE_PACKAGES
from pytest_enginecheck.targets.vllm.probe import allowed_plugins, probe


@dataclass(frozen=True)
class PluginEntry:
    """One installed entry point of the general-plugins group."""

    name: str
    value: str  # "module:function"
    distribution: str

    @property
    def module(self) -> str:
        return self.value.split(":", 1)[0]


def _entry_points() -> list[EntryPoint]:
    group = probe().plugins_group
    allowed = allowed_plugins()
    return [ep for ep in entry_points(group=group) if allowed is None or ep.name in allowed]


def list_plugins() -> list[PluginEntry]:
    """The entry points vLLM would load here (its group, filtered by VLLM_PLUGINS)."""
    return [PluginEntry(ep.name, ep.value, ep.dist.name if ep.dist else "?") for ep in _entry_points()]


def _user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The exception's frames outside importlib, pytest_enginecheck and vLLM's plugin loader."""
    return [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename
            and not f.filename.startswith("<frozen") and "pytest_enginecheck" not in f.filename
            and not f.filename.endswith(os.path.join("vllm", "plugins", "__init__.py"))]


def user_traceback(exc: BaseException) -> str:
    """The exception's user frames (see ``_user_frames``), then the exception."""
    return "".join(traceback.format_list(_user_frames(exc))) + "".join(traceback.format_exception_only(exc))


def run_plugin(entry: PluginEntry, strict: bool = False) -> PluginOutcome:
    """Load and call one plugin under the guard, as vLLM's loader does (``ep.load()()``)."""
    (ep,) = [ep for ep in entry_points(group=probe().plugins_group) if ep.name == entry.name
             and ep.value == entry.value]
    outcome = PluginOutcome(entry)
    with CudaGuard(strict=strict, engine_packages=ENGINE_PACKAGES) as guard:
        try:
            ep.load()()
        except BaseException as e:  # noqa: BLE001 - reported as the plugin's failure
            outcome.error, outcome.traceback = e, user_traceback(e)
            frames = _user_frames(e)
            outcome.location = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
    outcome.accesses = sorted(guard.accesses, key=lambda a: a.kind != "init")
    return outcome


_loaded: list[PluginOutcome] | None = None


def load_plugins(strict: bool = False) -> list[PluginOutcome]:
    """Run every allowed plugin once per process, each under the guard, keeping what each one registered;
    failures are kept, not raised (the description reports them; the other plugins' architectures stay listed)."""
    global _loaded
    if _loaded is None:
        _loaded = []
        models = probe().registry.models
        for entry in list_plugins():
            before = dict(models)
            outcome = run_plugin(entry, strict)
            outcome.registered = tuple(arch for arch, model in models.items() if before.get(arch) is not model)
            _loaded.append(outcome)
    return _loaded


def _registered_architectures() -> list[str]:
    return sorted(probe().registry.models)


def run_in_engine_state(entry: PluginEntry) -> tuple[bool, str, str]:
    """Load only this plugin in vLLM's inspection subprocess: (succeeded, its stderr or the architectures,
    what that state is), the loader interface of ``checks/plugins_check.py``."""
    api = probe()
    state = f"vLLM's inspection subprocess ({' '.join(api.subprocess_command)})"
    if api.run_in_subprocess is None:
        return True, "this vLLM has no inspection subprocess (_run_in_subprocess); nothing to check", state
    saved = os.environ.get("VLLM_PLUGINS")
    os.environ["VLLM_PLUGINS"] = entry.name
    try:
        return True, ", ".join(api.run_in_subprocess(_registered_architectures)), state
    except Exception as e:  # noqa: BLE001 - the subprocess's stderr is the report
        return False, str(e), state
    finally:
        if saved is None:
            os.environ.pop("VLLM_PLUGINS")
        else:
            os.environ["VLLM_PLUGINS"] = saved
