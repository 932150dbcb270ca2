"""plugins: each installed general plugin of the target loads without CUDA and without error, in this warm
child under the CUDA guard and again in the process state where the engine itself first loads plugins.

One item per entry point, ``enginecheck::plugin:<name>::plugins`` (``ctx.plugin`` is the entry point's
name, ``ctx.module`` its module). What is the engine's is its target's ``PluginLoader``
(``pytest_enginecheck.targets``): listing the plugins, loading one under the guard, and loading it in the
engine's own process state.

A plugin that raises while the target is described is not an item of this check: it is a collection error
under its name (see ``targets.PluginError``), as pytest reports a test module that fails to import.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.checks.failures import cuda_failure, root_line
from pytest_enginecheck.targets import PluginError, PluginLoader, PluginOutcome, Target, load_target


def plugin_label(target: Target, entry: Any) -> str:
    """How a report names a plugin: ``engine_ref plugin 'oot' (pkg.plugin:register) of distribution pkg``."""
    return f"{target.label} plugin {entry.name!r} ({entry.value}) of distribution {entry.distribution}"


def loading_failure(target: Target, entry: Any, outcome: PluginOutcome) -> CheckFailure | None:
    """What loading ``entry`` under the guard did wrong: the CUDA access it made, else the exception it raised;
    None when it did neither."""
    who = plugin_label(target, entry)
    if outcome.accesses:
        return cuda_failure(f"Loading {who}", outcome.accesses[0], entry.module)
    if outcome.error is not None:
        return CheckFailure(
            f"Loading {who} raised {type(outcome.error).__name__}: {outcome.error}"
            + (f" at {outcome.location}" if outcome.location else ""),
            {"kind": "plugin_error", "traceback": outcome.traceback})
    return None


def plugin_errors(target: Target, outcomes: Iterable[PluginOutcome]) -> tuple[PluginError, ...]:
    """The plugins among ``outcomes`` (the loader's ``load_plugins``) that raised."""
    errors = []
    for outcome in outcomes:
        failure = loading_failure(target, outcome.entry, outcome) if outcome.error is not None else None
        if failure is not None:
            entry = outcome.entry
            errors.append(PluginError(entry.name, entry.value, entry.distribution, failure.message, outcome.traceback,
                                      outcome.registered))
    return tuple(errors)


def _entry(ctx: CheckContext, plugins: PluginLoader) -> Any:
    found = [e for e in plugins.list_plugins() if e.name == ctx.plugin and e.module == ctx.module]
    if not found:
        raise CheckFailure(f"plugin {ctx.plugin!r} ({ctx.module}) is no longer installed or allowed here",
                           {"kind": "missing_plugin"})
    return found[0]


def run(ctx: CheckContext) -> dict[str, Any]:
    target = load_target(ctx.spec)
    plugins = target.plugin_loader()
    if plugins is None:
        raise CheckFailure(f"--enginecheck-target={ctx.spec!r} has no general plugins, but an item of the plugins "
                           f"check ({ctx.plugin!r}) was generated for it", {"kind": "missing_plugin"})
    entry = _entry(ctx, plugins)
    failure = loading_failure(target, entry, plugins.run_plugin(entry, strict=ctx.options.strict))
    if failure is not None:
        raise failure
    ok, output, state = plugins.run_in_engine_state(entry)
    if not ok:
        raise CheckFailure(f"Loading {plugin_label(target, entry)} works here but fails in {state}: "
                           f"{root_line(output)}", {"kind": "plugin_engine_state", "traceback": output})
    return {"entry_point": entry.value, "distribution": entry.distribution}
