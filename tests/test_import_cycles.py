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


# -- packages: every import counts, those inside functions too --------------------------------------------------------

TARGETS = ROOT / "pytest_enginecheck" / "targets"
CORE = ("pytest_enginecheck", "pytest_enginecheck.checks", "pytest_enginecheck.targets")  # engine-agnostic


def _runtime_nodes(node: ast.AST) -> list[ast.AST]:
    """Every node below ``node``, but for ``if TYPE_CHECKING:`` blocks (types only, never imported at run time) and
    ``if __name__ == "__main__":`` blocks (they run in the module ``__main__``, not in this one)."""
    found = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and ("TYPE_CHECKING" in ast.unparse(child.test)
                                          or "__name__" in ast.unparse(child.test)):
            continue
        found += [child, *_runtime_nodes(child)]
    return found


def all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports at run time anywhere (inside functions too), absolute names."""
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def unit(module: str) -> str:
    """The node of the package graph a module belongs to: its sub-package (a target's folder, ``checks``), or the
    module itself for the top level's modules."""
    parts = module.split(".")
    if parts[:2] == ["pytest_enginecheck", "targets"] and len(parts) > 2 and (TARGETS / parts[2]).is_dir():
        return ".".join(parts[:3])
    if len(parts) > 1 and (ROOT.joinpath(*parts[:2])).is_dir():
        return ".".join(parts[:2])
    return module


def package_graph() -> dict[str, set[str]]:
    modules = {module_name(p) for p in (ROOT / "pytest_enginecheck").rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in (ROOT / "pytest_enginecheck").rglob("*.py"):
        here = unit(module_name(path))
        there = {unit(m) for m in all_imports(path) if m in modules}
        edges.setdefault(here, set()).update(there - {here})
    return edges


def test_no_cycle_between_packages() -> None:
    """Counting imports inside functions too: checks/ never reaches back into a target that imports it."""
    edges = package_graph()
    assert {"pytest_enginecheck.checks", "pytest_enginecheck.targets.vllm"} <= set(edges), "the graph was not built"
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_no_import_between_sibling_targets() -> None:
    targets = sorted(p.name for p in TARGETS.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert {"engine_ref", "vllm"} <= set(targets)
    for name in targets:
        for path in (TARGETS / name).rglob("*.py"):
            siblings = {m for m in all_imports(path) for other in targets
                        if other != name and (m == f"pytest_enginecheck.targets.{other}"
                                              or m.startswith(f"pytest_enginecheck.targets.{other}."))}
            assert not siblings, f"{path.relative_to(ROOT)} imports another target: {sorted(siblings)}"


def test_the_core_names_no_engine() -> None:
    """The plugin, session, runner, options and checks/ import no target and no engine, and no string in them is a
    target's name (the default target's name is defined once, in targets/__init__.py)."""
    targets = {p.name for p in TARGETS.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    core = [p for p in (ROOT / "pytest_enginecheck").rglob("*.py") if unit(module_name(p)) in CORE
            or (unit(module_name(p)).count(".") == 1 and not module_name(p).startswith("pytest_enginecheck.targets."))]
    assert any(p.name == "session.py" for p in core) and any(p.name == "runner.py" for p in core)
    for path in core:
        imported = {m for m in all_imports(path) if m.split(".")[0] in targets - {"engine_ref"}
                    or (m.startswith("pytest_enginecheck.targets.") and m.split(".")[2] in targets)}
        assert not imported, f"{path.relative_to(ROOT)} imports an engine's target: {sorted(imported)}"
        tree = ast.parse(path.read_text())
        named = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in targets}
        if path == TARGETS / "__init__.py":
            named -= {"engine_ref"}  # DEFAULT_TARGET
        assert not named, f"{path.relative_to(ROOT)} names an engine: {sorted(named)}"


def test_the_package_check_finds_a_cycle_through_a_function_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from pytest_enginecheck.targets.vllm import checks\n"
                      "if TYPE_CHECKING:\n    from pytest_enginecheck.session import EngineCheckSession\n")
    assert all_imports(module) == {"pytest_enginecheck.targets.vllm", "pytest_enginecheck.targets.vllm.checks"}
    assert unit("pytest_enginecheck.targets.vllm.checks") == "pytest_enginecheck.targets.vllm"
    assert unit("pytest_enginecheck.checks.runner") == "pytest_enginecheck.checks"
    assert unit("pytest_enginecheck.session") == "pytest_enginecheck.session"
