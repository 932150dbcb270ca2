"""The checks of ``--enginecheck-target=sglang``, each run in a warm check child (a fork of the warm parent, which
preloaded SGLang's common modules but no model module).

- import: the core import check (``checks/import_check.py``: the module under the CUDA guard, the class by its
  name in the module), then what SGLang's registry reads from it: ``EntryClass`` holds that class, under the
  architecture's name. A module whose import raises is one SGLang's registry drops with a logged warning, and
  the failure says so (one that touches CUDA imports, and initializes CUDA at import where there is a GPU).
- inspect: the class meets what SGLang's registry, model loader and model runner need of it (``requirements``).
- plugins: the core plugins check, with ``plugins`` (the out-of-tree package) as the loader.
"""

from __future__ import annotations

import sys
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, import_check
from pytest_enginecheck.targets.sglang.discovery import ENTRY_CLASS
from pytest_enginecheck.targets.sglang.requirements import served_with, unmet


def entry_classes(module: Any) -> list[Any] | None:
    """The module's ``EntryClass`` as SGLang's registry reads it (a class or a list); None without one."""
    if not hasattr(module, ENTRY_CLASS):
        return None
    entry = getattr(module, ENTRY_CLASS)
    return list(entry) if isinstance(entry, list) else [entry]


def _dropped(ctx: CheckContext) -> str:
    return (f"SGLang's registry (registry.import_model_classes) drops a module that fails to import with only a "
            f"logged warning ('Ignore import error when loading {ctx.module}'): {ctx.architecture} is then "
            f"\"not supported\" by SGLang.")


def _classes(ctx: CheckContext) -> tuple[list[type], dict[str, Any]]:
    """Import the module (the core import check) and return the classes of it the item stands for, and the import
    check's detail (its import profile)."""
    try:
        imported = import_check.run(ctx)
    except CheckFailure as failure:
        if failure.detail.get("kind") not in ("missing_class", "cuda"):  # it raised: SGLang's scan would drop it
            failure.message = f"{failure.message}\n{_dropped(ctx)}"
        raise
    module = sys.modules[ctx.module]
    entries = entry_classes(module)
    if entries is None:
        raise CheckFailure(f"Module {ctx.module} imports cleanly but has no {ENTRY_CLASS} at run time (its source "
                           f"assigns one): SGLang's registry serves none of its classes.",
                           {"kind": "missing_class", "module": ctx.module, "class": ENTRY_CLASS})
    if ctx.class_name == ENTRY_CLASS:  # an EntryClass its source does not spell out: what it holds is what counts
        return entries, imported
    cls = getattr(module, ctx.class_name)
    names = [getattr(e, "__name__", repr(e)) for e in entries]
    if not any(e is cls for e in entries) or getattr(cls, "__name__", None) != ctx.architecture:
        raise CheckFailure(
            f"Module {ctx.module} imports cleanly, but its {ENTRY_CLASS} holds {', '.join(names) or 'nothing'} at "
            f"run time, not {ctx.architecture} ({ctx.class_name} in its source): SGLang's registry serves what "
            f"{ENTRY_CLASS} holds, by __name__.",
            {"kind": "missing_class", "module": ctx.module, "class": ctx.class_name, "entry_classes": names})
    return [cls], imported


def run_import(ctx: CheckContext) -> dict[str, Any]:
    """import: the module imports without CUDA and its ``EntryClass`` holds the architecture's class."""
    classes, imported = _classes(ctx)
    return {**imported, "entry_classes": [getattr(c, "__name__", repr(c)) for c in classes]}


def run_inspect(ctx: CheckContext) -> dict[str, Any]:
    """inspect: SGLang can resolve, build, load and run the class by what it is (``requirements``)."""
    classes, _ = _classes(ctx)
    problems = {getattr(c, "__name__", repr(c)): unmet(c, getattr(c, "__name__", ctx.architecture)
                                                       if ctx.class_name == ENTRY_CLASS else ctx.architecture)
                for c in classes}
    problems = {name: found for name, found in problems.items() if found}
    if problems:
        raise CheckFailure("; ".join(f"SGLang cannot serve {name}: {'; '.join(found)}"
                                     for name, found in problems.items()),
                           {"kind": "inspection", "unmet": problems})
    return {"classes": {c.__name__: served_with(c) for c in classes}}


CHECK_FUNCTIONS = {"import": run_import, "inspect": run_inspect}
