"""Targets: the engines ``--enginecheck`` checks, each behind one interface, ``Target``.

A target is found by name in the entry-point group ``pytest_enginecheck.targets``: the entry point's object is
called with the spec (``--enginecheck-target``) and returns the Target. This project registers ``engine_ref``,
``vllm`` and ``sglang`` in its own pyproject.toml; a third party ships a target for its engine the same way,
without touching this project. A ``module:attribute`` spec is a kind of the default target (an engine_ref
``ModelRegistry``, or a mapping of architecture -> ``"module:Class"``, the string form of vLLM's register_model).

Each target lives in a folder of its own below this package and imports no other target. The pytest process asks
a target only what needs no engine import (``offered``, ``options``, ``plugin_group``, ``warm_parent_modules``,
``prepare_children``); ``describe`` and the check functions run in check processes. A target adds options of its own
(``Target.options``) beside the core's; the core's plugins check runs on every target that has general plugins.
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pytest_enginecheck.checks import CheckContext
    from pytest_enginecheck.settings import Settings

TARGETS_GROUP = "pytest_enginecheck.targets"
DEFAULT_TARGET = "engine_ref"  # the bundled engine: --enginecheck-target's default, and module:attribute's kind

CheckFunction = Callable[["CheckContext"], dict[str, Any]]


class TargetError(Exception):
    """The target spec cannot be resolved; the message says what to pass instead."""


@dataclass(frozen=True)
class ArchEntry:
    """Where an architecture's class lives."""

    architecture: str
    module: str
    class_name: str


@dataclass(frozen=True)
class PluginGroup:
    """A target's general plugins: the entry-point group its engine loads, and the environment variable that
    restricts them by name (comma-separated names; empty loads none; unset loads all)."""

    group: str
    variable: str

    def names(self) -> list[str]:
        """The installed entry points' names, allowed by the variable."""
        names = [ep.name for ep in entry_points(group=self.group)]
        allowed = os.environ.get(self.variable)
        if allowed is None:
            return names
        return [name for name in names if name in {a.strip() for a in allowed.split(",")}]


@dataclass(frozen=True)
class Offer:
    """The checks a target offers here, and why it does not offer the others (check -> one sentence)."""

    checks: tuple[str, ...]
    refused: tuple[tuple[str, str], ...] = ()
    # what the settings lines say beside the offer (a release newer than the newest the target was measured on)
    notes: tuple[str, ...] = ()

    def why_not(self, check: str) -> str | None:
        return dict(self.refused).get(check)

    def sentence(self) -> str:
        """The settings line's ``not offered`` part: the refused checks grouped by reason ('' when none)."""
        by_reason: dict[str, list[str]] = {}
        for check, reason in self.refused:
            by_reason.setdefault(reason, []).append(check)
        return "; ".join(f"{', '.join(checks)} ({reason})" for reason, checks in by_reason.items())


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
    """What the pytest process needs to generate items: the architectures, the plugins and the checks offered."""

    spec: str
    kind: str  # the target's name, or a kind of it ("mapping")
    entries: tuple[ArchEntry, ...]
    offer: Offer
    plugins: tuple[tuple[str, str, str], ...] = ()  # the target's general plugins: (name, value, distribution)
    plugin_errors: tuple[PluginError, ...] = ()  # the plugins that raised while it was described
    from_plugins: tuple[str, ...] = ()  # the architectures its general plugins registered (an author's own models)


@dataclass(frozen=True)
class TargetOption:
    """An option of one target (``Target.options``): ``--enginecheck-<name>`` and its ini twin ``enginecheck_<name>``,
    registered, read and refused as the core's own options are (``options.py``) and kept in ``Settings.target_options``.
    Its help ends with the checks whose ``CheckSpec.options`` name it."""

    name: str
    help: str
    default: str
    choices: tuple[str, ...] = ()  # empty: any value
    metavar: str | None = None

    def value(self, options: Settings) -> str:
        """Its value in a run's settings (``ctx.options``): the one resolved, else its default."""
        return dict(options.target_options).get(self.name, self.default)


class PluginEntry(Protocol):
    """An installed general plugin, as a loader lists it."""

    @property
    def name(self) -> str: ...

    @property
    def value(self) -> str:
        """``module:function``."""

    @property
    def distribution(self) -> str: ...

    @property
    def module(self) -> str: ...


@dataclass
class PluginOutcome:
    """What loading one plugin under the guard did (``PluginLoader.run_plugin``)."""

    entry: Any
    accesses: list[Any] = field(default_factory=list)  # the guard's CudaAccess records, the worst first
    error: BaseException | None = None
    traceback: str = ""
    location: str | None = None  # "file:line" of the plugin's own frame that raised
    registered: tuple[str, ...] = ()  # the architectures it added to (or replaced in) the registry (load_plugins)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.accesses


class PluginLoader(Protocol):
    """How a target's general plugins are listed and loaded (the plugins check and the description use it)."""

    def list_plugins(self) -> Sequence[PluginEntry]:
        """The installed entry points the engine would load (its environment variable honoured)."""

    def run_plugin(self, entry: Any, strict: bool = False) -> PluginOutcome:
        """Load and call one plugin under the CUDA guard, as the engine does."""

    def load_plugins(self, strict: bool = False) -> Sequence[PluginOutcome]:
        """Every allowed plugin's outcome, each with what it registered: how the target is described."""

    def run_in_engine_state(self, entry: Any) -> tuple[bool, str, str]:
        """Load only this plugin in the process state where the engine first loads plugins:
        ``(ok, output, what that state is)``."""


class Target(ABC):
    """An engine ``--enginecheck`` can check. Subclass it, and register a factory ``(spec) -> Target`` in the
    entry-point group ``pytest_enginecheck.targets`` under the target's name.

    Override what the engine has: ``describe``, ``offered`` and ``check_function`` always (or subclass
    ``pytest_enginecheck.registry_target.RegistryTarget``, whose ``describe`` is the shared one); ``plugin_loader``
    and ``plugin_group`` where it has general plugins; ``options`` for options of its own; ``warm_parent_modules``
    for what every check child would import (preloaded once instead); ``prepare_children`` for the environment check
    children inherit.
    """

    name: str = ""  # the entry point's name: what --enginecheck-target takes
    label: str = ""  # how messages name the engine ("vLLM")
    options: tuple[TargetOption, ...] = ()  # its own options, beside the core's (registered whichever target runs)
    plugin_group: PluginGroup | None = None
    # The engine's own packages: strict mode does not blame a model for CUDA queries made while they import.
    engine_packages: tuple[str, ...] = ()

    def __init__(self, spec: str) -> None:
        self.spec = spec

    @abstractmethod
    def offered(self) -> Offer:
        """The checks offered here, decided without importing the engine (a check the target cannot run is a usage
        error at once), with a sentence per refused check that says why and what to do."""

    @abstractmethod
    def describe(self, strict: bool = False) -> TargetDescription:
        """Resolve the target (in a check process) and list its architectures and general plugins; a plugin that
        raises is kept in ``plugin_errors`` and what it registered is left out of ``entries``."""

    @abstractmethod
    def check_function(self, check: str) -> CheckFunction:
        """The function that runs ``check`` in its child: returns the passing result's detail, or raises
        CheckFailure / CheckSkip (see ``pytest_enginecheck.checks``). Never asked for ``plugins``: the runner runs
        the core's plugins check, through ``plugin_loader``."""

    def plugin_loader(self) -> PluginLoader | None:
        """How the target's general plugins are loaded; None when it has none."""
        return None

    def warm_parent_modules(self, checks: tuple[str, ...], strict: bool = False) -> tuple[str, ...]:
        """What the warm parent preloads for the selected checks (called in the pytest process, before the first
        check child starts; it may set environment variables the warm parent reads)."""
        return ()

    def prepare_children(self, workdir: str) -> None:
        """Set up the environment every check child inherits (called in the pytest process before the warm parent
        starts): e.g. point the engine's caches into the session's ``workdir``."""
        return

    def check_settings(self, settings: Settings) -> None:
        """Refuse an option value this target cannot run (raise TargetError naming the value and the fix)."""
        return

    def cache_counts(self) -> dict[str, int] | None:
        """This process's lookups of the engine's ModelInfo cache so far, by how each was served (``memory``,
        ``disk``, ``missing``, ``source_changed``, ...), for the run's cache line; None when it cannot tell."""
        return None

    def library_packages(self) -> tuple[str, ...]:
        """The engine's own top-level packages: a failure's traceback shows their frames only up to the author's last
        frame (``output.Authorship``; a registered module inside them is still the author's). ``engine_packages`` by
        default."""
        return self.engine_packages

    def plugin_count(self) -> int:
        """How many general plugins the engine would load here."""
        return len(self.plugin_group.names()) if self.plugin_group else 0


@functools.cache
def _factories() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=TARGETS_GROUP)}


def target_names() -> tuple[str, ...]:
    """The installed targets' names."""
    return tuple(sorted(_factories()))


def usage() -> str:
    return (f"use one of {', '.join(map(repr, target_names()))} (the entry points of {TARGETS_GROUP}), or "
            f"'module:attribute' naming a mapping of architecture -> 'module:Class' or an engine_ref ModelRegistry")


@functools.cache
def load_target(spec: str) -> Target:
    """The Target a spec names: an installed target's name, or ``module:attribute`` (a kind of the default)."""
    factories = _factories()
    name = spec if spec in factories else DEFAULT_TARGET if ":" in spec else None
    if name is None or name not in factories:
        raise TargetError(f"--enginecheck-target={spec!r} is not a target: {usage()}.")
    try:
        target = factories[name].load()(spec)
    except TargetError:
        raise
    except Exception as e:  # noqa: BLE001 - a broken third-party target, named
        raise TargetError(f"--enginecheck-target={spec!r}: its entry point {factories[name].value!r} "
                          f"({TARGETS_GROUP}) failed to load: {type(e).__name__}: {e}") from None
    if not isinstance(target, Target):
        raise TargetError(f"--enginecheck-target={spec!r}: its entry point {factories[name].value!r} returned a "
                          f"{type(target).__name__}, not a pytest_enginecheck.targets.Target")
    return target


def declared_options() -> tuple[TargetOption, ...]:
    """Every installed target's own options (``Target.options``), in the order of the targets' names; a target whose
    entry point fails to load declares none (selecting it is the error that says why)."""
    found: list[TargetOption] = []
    for name in target_names():
        try:
            found += load_target(name).options
        except TargetError:
            continue
    return tuple(found)


def without_failed(entries: Iterable[ArchEntry], plugins: Iterable[PluginEntry], errors: tuple[PluginError, ...]
                   ) -> tuple[tuple[ArchEntry, ...], tuple[tuple[str, str, str], ...]]:
    """The entries and plugins left to check: a failed plugin is a collection error, not an item, and so are the
    architectures it registered before it raised."""
    lost = {arch for error in errors for arch in error.lost}
    failed = {error.name for error in errors}
    return (tuple(e for e in entries if e.architecture not in lost),
            tuple((p.name, p.value, p.distribution) for p in plugins if p.name not in failed))


def describe(spec: str, strict: bool = False) -> TargetDescription:
    """The description of the target ``spec`` names (run in a check process: it imports the engine)."""
    return load_target(spec).describe(strict)


def other_targets_plugins(spec: str) -> list[tuple[str, list[str]]]:
    """The installed targets other than ``spec``'s whose engines have general plugins installed here:
    (target name, plugin names), for a run that checked none of them."""
    found = []
    for name in target_names():
        if name == spec:
            continue
        try:
            group = load_target(name).plugin_group
        except TargetError:
            continue
        if group is not None and (names := [ep.name for ep in entry_points(group=group.group)]):
            found.append((name, names))
    return found
