"""SGLang's model modules and their ``EntryClass``, found without importing them.

SGLang's registry (``sglang/srt/models/registry.py: import_model_classes``) walks a package with
``pkgutil.iter_modules`` (plain modules only, not subpackages, minus those named in
``SGLANG_DISABLED_MODEL_ARCHS``), imports each one and registers every class of its ``EntryClass`` (a
class or a list of classes) under the class's ``__name__``. Importing them all in one process is what
the checks must not do (it costs minutes, and SGLang's scan drops a module that fails), so here the
package is located through its spec (no ``__init__`` runs), listed as SGLang lists it, and each
module's ``EntryClass`` read from its source's AST. A name in ``EntryClass`` is resolved to the
class's ``__name__`` as far as the module's own source says (a class it defines, ``from m import A as
B``, ``B = A``); the import check proves each listed class is really there under that name.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pkgutil
from dataclasses import dataclass
from pathlib import Path

IN_TREE_PACKAGE = "sglang.srt.models"
DISABLED_VARIABLE = "SGLANG_DISABLED_MODEL_ARCHS"  # module basenames SGLang's scan skips (comma-separated)
ENTRY_CLASS = "EntryClass"


class DiscoveryError(Exception):
    """A package that cannot be located or a module that cannot be parsed; the message names it."""


@dataclass(frozen=True)
class ModelModule:
    """One module SGLang's scan imports, and the architectures its ``EntryClass`` lists.

    ``classes``: (architecture, the name it has in the module) pairs; ``opaque`` when ``EntryClass`` is not a
    literal class or list of classes (then only importing the module tells what it holds).
    """

    name: str
    path: str
    classes: tuple[tuple[str, str], ...] = ()
    opaque: bool = False


def package_paths(package: str) -> list[str]:
    """The directories of ``package`` (dotted), found through import specs without importing it or its parents."""
    parts = package.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: found, not imported
    except (ImportError, ValueError) as e:
        raise DiscoveryError(f"package {package!r} cannot be located: {e}") from None
    paths = list(spec.submodule_search_locations or ()) if spec is not None else []
    for part in parts[1:]:  # a subpackage is a directory of its parent's (regular or namespace)
        paths = [os.path.join(p, part) for p in paths if os.path.isdir(os.path.join(p, part))]
    if not paths:
        raise DiscoveryError(f"package {package!r} is not installed here (no package directory on sys.path); "
                             f"install it, or put its parent directory on PYTHONPATH")
    return paths


def disabled_modules() -> set[str]:
    """The module basenames ``SGLANG_DISABLED_MODEL_ARCHS`` tells SGLang's scan to skip."""
    return {name.strip() for name in os.environ.get(DISABLED_VARIABLE, "").split(",") if name.strip()}


def list_modules(package: str) -> list[tuple[str, str]]:
    """(module name, source path) of each module SGLang's scan would import from ``package``, sorted by name."""
    found = []
    skipped = disabled_modules()
    for info in pkgutil.iter_modules(package_paths(package), package + "."):
        if info.ispkg or info.name.rsplit(".", 1)[-1] in skipped:
            continue
        path = Path(getattr(info.module_finder, "path", "")) / (info.name.rsplit(".", 1)[-1] + ".py")
        found.append((info.name, str(path)))
    return sorted(found)


def _bindings(tree: ast.Module) -> dict[str, str | None]:
    """What each top-level name refers to: itself for a class it defines, the original name of an import
    (``from m import A as B``: ``A``), the name assigned to it (``B = A``: ``A``), else None (unknown)."""
    bound: dict[str, str | None] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bound[node.name] = node.name
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                bound[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id != ENTRY_CLASS:
                    bound[target.id] = f"={node.value.id}"
    return bound


def _class_name(name: str, bound: dict[str, str | None]) -> str:
    """The ``__name__`` of the class the module's name ``name`` refers to, as far as its source tells."""
    seen = set()
    while name not in seen:
        seen.add(name)
        value = bound.get(name)
        if value is None or not value.startswith("="):
            return value or name
        name = value[1:]
    return name


def _binds_entry(node: ast.stmt) -> bool:
    """Whether the statement binds ``EntryClass`` by an import or an augmented assignment (not spelled out)."""
    if isinstance(node, ast.AugAssign):
        return isinstance(node.target, ast.Name) and node.target.id == ENTRY_CLASS
    return isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == ENTRY_CLASS for a in node.names)


def _assigned(node: ast.stmt) -> ast.expr | None:
    """The value of ``EntryClass = ...`` or ``EntryClass: T = ...``; None for any other statement."""
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == ENTRY_CLASS for t in node.targets):
        return node.value
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == ENTRY_CLASS:
        return node.value
    return None


def _entry_value(tree: ast.Module) -> ast.expr | bool | None:
    """The last top-level ``EntryClass = ...``'s value; None when there is none; False when it is bound another
    way (an import, an augmented assignment)."""
    value: ast.expr | bool | None = None
    for node in tree.body:
        assigned = _assigned(node)
        if assigned is not None:
            value = assigned
        elif _binds_entry(node):
            value = False
    return value


def parse_module(name: str, path: str) -> ModelModule:
    """The module's ``EntryClass``, read from its source."""
    try:
        tree = ast.parse(Path(path).read_bytes(), filename=path)
    except (OSError, SyntaxError, ValueError) as e:
        raise DiscoveryError(f"{name} ({path}) cannot be parsed: {e}") from None
    value = _entry_value(tree)
    if value is None:
        return ModelModule(name, path)
    elements = value.elts if isinstance(value, ast.List | ast.Tuple) else [value] if value is not False else None
    if elements is None or not all(isinstance(e, ast.Name) for e in elements):
        return ModelModule(name, path, opaque=True)
    bound = _bindings(tree)
    names = [e.id for e in elements if isinstance(e, ast.Name)]
    return ModelModule(name, path, tuple((_class_name(n, bound), n) for n in names))


def discover(package: str) -> list[ModelModule]:
    """Every module SGLang's scan imports from ``package``, with the architectures its source lists."""
    return [parse_module(name, path) for name, path in list_modules(package)]
