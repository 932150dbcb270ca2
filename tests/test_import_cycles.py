"""Neither package has an import cycle among its modules' top-level imports.

Imports inside functions and under ``if TYPE_CHECKING:`` are deliberate late bindings (the plugin
must not import torch when it loads) and are not edges. A package's ``__init__`` counts as the
package: importing ``a.b`` runs ``a/__init__.py`` first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path, package: str) -> set[str]:
    """The package's modules that ``path`` imports when it is imported."""
    name = module_name(path)
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in [node] if not isinstance(node, ast.Try) else [*node.body, *node.finalbody]:
            if isinstance(sub, ast.Import):
                found.update(alias.name for alias in sub.names)
            elif isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(anchor[: len(anchor) - sub.level + 1] + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in sub.names)
    return {m for m in found if m == package or m.startswith(package + ".")}


def graph(package: str) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in (ROOT / package).rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {t for t in top_level_imports(path, package) if t in modules and t != name}
        # importing a.b.c runs a/__init__ and a/b/__init__ first
        edges[name] = {p for t in targets for p in [".".join(t.split(".")[:i]) for i in range(1, t.count(".") + 2)]
                       if p in modules and p != name and not name.startswith(p + ".")}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.parametrize("package", ["engine_ref", "pytest_enginecheck"])
def test_no_import_cycle(package: str) -> None:
    edges = graph(package)
    assert len(edges) > 10 and any(edges.values()), "the graph was not built"
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_the_check_finds_a_cycle() -> None:
    assert find_cycle({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}}) == ["a.x", "a.y", "a.z", "a.x"]
