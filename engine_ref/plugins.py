"""General plugins: code that packages run in every engine process before the engine starts.

A package declares an entry point in the group ``engine_ref.general_plugins``; its callable runs
once per process (typically ``ModelRegistry.register_model(...)`` for out-of-tree models).
ENGINE_REF_PLUGINS restricts which entry points load (by name). A plugin that fails stops the
engine with a PluginLoadError naming its distribution, entry point and cause: its architectures
would otherwise vanish and the engine would start without them.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from engine_ref import envs
from engine_ref.errors import EngineRefError

logger = logging.getLogger(__name__)

PLUGINS_GROUP = "engine_ref.general_plugins"


class PluginLoadError(EngineRefError):
    """One or more general plugins raised while loading; ``failures`` holds each one."""

    def __init__(self, message: str, failures: list[PluginFailure] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or []


@dataclass(frozen=True)
class PluginEntry:
    """One installed entry point of the general-plugins group."""

    name: str
    value: str  # "module:function"
    distribution: str

    @property
    def module(self) -> str:
        return self.value.split(":", 1)[0]

    def describe(self) -> str:
        return f"engine_ref plugin {self.name!r} ({self.value}) of distribution {self.distribution}"


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that raised: the exception as one line, and where in the plugin's code it was raised."""

    entry: PluginEntry
    error: str
    location: str | None
    traceback: str

    def describe(self) -> str:
        where = f" at {self.location}" if self.location else ""
        return f"{self.entry.describe()} raised {self.error}{where}"


def _entry_points() -> list[EntryPoint]:
    allowed = envs.allowed_plugins()
    return [ep for ep in entry_points(group=PLUGINS_GROUP) if allowed is None or ep.name in allowed]


def list_plugins() -> list[PluginEntry]:
    """The entry points that load here: the group's, filtered by ENGINE_REF_PLUGINS. Imports none of them."""
    return [PluginEntry(ep.name, ep.value, ep.dist.name if ep.dist else "?") for ep in _entry_points()]


def run_plugin(entry: PluginEntry) -> None:
    """Load and call one plugin (``ep.load()()``); its exception propagates."""
    (ep,) = [ep for ep in entry_points(group=PLUGINS_GROUP) if (ep.name, ep.value) == (entry.name, entry.value)]
    ep.load()()


def capture_failure(entry: PluginEntry, exc: BaseException, skip: tuple[str, ...] = ()) -> PluginFailure:
    """The failure of ``entry``: the exception, where the plugin's own package raised it (else the innermost
    frame), and the traceback without importlib's frames and the callers' (``skip``: their files)."""
    skipped = (__file__, *skip)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<frozen") and "importlib" not in f.filename and f.filename not in skipped]
    package = sys.modules.get(entry.module.partition(".")[0])
    root = os.path.dirname(getattr(package, "__file__", None) or "\0") + os.sep
    own = [f for f in frames if f.filename.startswith(root)] or frames
    location = f"{own[-1].filename}:{own[-1].lineno}" if own else None
    text = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(exc))
    return PluginFailure(entry, f"{type(exc).__name__}: {exc}", location, text)


def plugin_load_error(failures: list[PluginFailure]) -> PluginLoadError:
    """The error for plugins that failed, with how to start without them."""
    failed = {f.entry.name for f in failures}
    others = ",".join(e.name for e in list_plugins() if e.name not in failed)
    return PluginLoadError(
        "; ".join(f.describe() for f in failures) + ". Fix or uninstall it, or leave it out with "
        f"ENGINE_REF_PLUGINS={others!r} (the names to load; empty loads none).", failures)


_failures: list[PluginFailure] | None = None  # None: not loaded yet in this process
_reported = False


def load_general_plugins(raise_on_failure: bool = True) -> list[str]:
    """Load and run the allowed general plugins, once per process; return the names that ran.

    A plugin that raises does not stop the others; then PluginLoadError names every one that failed,
    on this call and on each later one. A caller that reports the failures itself
    (``raise_on_failure=False``, as pytest-enginecheck's plugins check does) gets them from
    ``plugin_failures()``, and the process goes on without those plugins.
    """
    global _failures, _reported
    loaded: list[str] = []
    if _failures is None:
        _failures = []
        for entry in list_plugins():
            try:
                run_plugin(entry)
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                _failures.append(capture_failure(entry, e))
                continue
            loaded.append(entry.name)
            logger.info("engine_ref plugin %r loaded", entry.name)
    if not raise_on_failure:
        _reported = True
    if _failures and not _reported:
        raise plugin_load_error(_failures)
    return loaded


def plugin_failures() -> list[PluginFailure]:
    """The plugins that failed when this process loaded them (empty before loading)."""
    return list(_failures or [])
