"""No import circle among a package's modules, and no module too long to read.

Two graphs. ``graph(package)`` has the imports a module runs when it is imported (top level, not under
``if TYPE_CHECKING:``). ``graph(package, runtime_imports)`` has every import it runs at all, those inside
functions too (not under ``if TYPE_CHECKING:`` nor ``if __name__ == "__main__":``): a late import does not make a
circle harmless, it only makes it fail later. A package's ``__init__`` counts as the package: importing ``a.b``
runs ``a/__init__.py`` first; importing a module's own parent package is no edge (it is running already).
"""

from __future__ import annotations

import ast
import functools
import itertools
import posixpath
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = ("engine_ref", "pytest_enginecheck")
Edges = dict[str, dict[str, int]]  # module -> {a module it imports: the line of that import}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(node: ast.Import | ast.ImportFrom, path: Path) -> set[str]:
    """The absolute names an import statement of ``path`` names: each module, and for ``from m import n`` also
    ``m.n`` (a module when ``n`` is one). A relative import is resolved in ``path``'s package."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = node.module or ""
    if node.level:
        name = module_name(path)
        anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
    return {base, *(f"{base}.{alias.name}" for alias in node.names)}


def _first_lines(nodes: list[ast.AST], path: Path) -> dict[str, int]:
    """Every name the import statements among ``nodes`` name, each with the line of its first import."""
    found: dict[str, int] = {}
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in imported_names(node, path):
                found[name] = min(found.get(name, node.lineno), node.lineno)
    return found


def top_level_imports(path: Path) -> dict[str, int]:
    """The modules ``path`` imports when it is imported, each with the line of its first import."""
    nodes: list[ast.AST] = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        nodes += [node] if not isinstance(node, ast.Try) else [*node.body, *node.finalbody]
    return _first_lines(nodes, path)


def graph(package: str, imports: Callable[[Path], Mapping[str, int]] = top_level_imports) -> Edges:
    """The package's modules, each with those of the package it imports (``imports``: which imports count)."""
    modules = {module_name(p): p for p in (ROOT / package).rglob("*.py")}
    edges: Edges = {}
    for name, path in modules.items():
        edges[name] = {}
        for target, line in imports(path).items():
            if target not in modules or target == name:
                continue
            # importing a.b.c runs a/__init__ and a/b/__init__ first
            for parent in (".".join(target.split(".")[:i]) for i in range(1, target.count(".") + 2)):
                if parent in modules and parent != name and not name.startswith(parent + "."):
                    edges[name][parent] = min(edges[name].get(parent, line), line)
    return edges


def find_cycle(edges: Mapping[str, Collection[str]]) -> list[str] | None:
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


@pytest.mark.parametrize("package", PACKAGES)
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


def runtime_imports(path: Path) -> dict[str, int]:
    """Every module ``path`` imports at run time anywhere (inside functions too), absolute names, each with the
    line of its first import."""
    return _first_lines(_runtime_nodes(ast.parse(path.read_text())), path)


def all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports at run time anywhere (inside functions too), absolute names."""
    return set(runtime_imports(path))


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


# -- modules: every import counts, those inside functions too ---------------------------------------------------------

#: Edges of a circle allowed because they are a factory's: a function that imports, when called, the implementation
#: it was asked for, which itself imports the interface. Each is an import inside a function (checked below).
FACTORY_EDGES: dict[tuple[str, str], str] = {
    # Executor.get_class("mp" | "uni" | "ray") (vLLM's seam: a backend's name or class): each backend subclasses
    # Executor, so abstract cannot import them at its top, and only the backend asked for is imported (ray is optional).
    ("engine_ref.executor.abstract", "engine_ref.executor.multiproc"): "Executor.get_class, backend 'mp'",
    ("engine_ref.executor.abstract", "engine_ref.executor.uniproc"): "Executor.get_class, backend 'uni'",
    ("engine_ref.executor.abstract", "engine_ref.executor.ray_distributed"): "Executor.get_class, backend 'ray'",
    # get_quantization_config (vLLM's, in quantization/__init__): a method's name -> its QuantizationConfig class.
    # A method's layer code imports linear and fused_moe, which import quantization.base_config (and so the
    # package); the methods are imported when asked for, so importing the layers imports none of them.
    ("engine_ref.model_executor.layers.quantization", "engine_ref.model_executor.layers.quantization.fp8"):
        "get_quantization_config, methods 'fp8' and 'fbgemm_fp8'",
    ("engine_ref.model_executor.layers.quantization", "engine_ref.model_executor.layers.quantization.int8"):
        "get_quantization_config, method 'int8'",
}

#: Every package (a folder with ``__init__.py``) of both trees: a circle is reported under the innermost one that
#: holds all its modules.
PACKAGE_DIRS = sorted(module_name(p) for top in PACKAGES for p in (ROOT / top).rglob("__init__.py"))


@functools.cache
def late_graph(package: str) -> Edges:
    """``graph`` counting every import a module runs, those inside functions too."""
    return graph(package, runtime_imports)


def reachable(edges: Mapping[str, Collection[str]], start: str) -> set[str]:
    """The modules ``start`` reaches through one edge or more (itself only when it is on a circle)."""
    seen: set[str] = set()
    todo = list(edges.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += edges.get(node, ())
    return seen


def knots(edges: Mapping[str, Collection[str]]) -> list[frozenset[str]]:
    """The modules on circles, as sets that each reach one another (strongly connected), sorted."""
    reach = {node: reachable(edges, node) for node in edges}
    found = {frozenset({node, *(m for m in reach[node] if node in reach.get(m, ()))}) for node in edges
             if node in reach[node]}
    return sorted(found, key=sorted)


def innermost_package(modules: Collection[str], packages: Collection[str]) -> str:
    """The innermost of ``packages`` that holds every one of ``modules``."""
    common = posixpath.commonpath([m.replace(".", "/") for m in modules]).split("/")
    while ".".join(common) not in packages and len(common) > 1:
        common.pop()
    return ".".join(common)


def source(module: str) -> Path:
    """The file of ``module`` (``__init__.py`` for a package), relative to the repository."""
    path = Path(*module.split("."))
    return path / "__init__.py" if (ROOT / path).is_dir() else path.with_suffix(".py")


def describe_knot(edges: Edges, knot: Collection[str]) -> str:
    """One circle through the knot, each edge with the file and line of its import, then every other import
    among the knot's modules (all of them may need to go to untie it)."""
    inside = {m: {t: line for t, line in edges[m].items() if t in knot} for m in sorted(knot)}
    circle = find_cycle(inside) or []
    steps = list(itertools.pairwise(circle))

    def edge(a: str, b: str) -> str:
        return f"  {a} -> {b}  ({source(a)}:{inside[a][b]})"

    text = [f"An import circle among {len(knot)} modules (imports inside functions count): move code so that "
            f"imports run one way, or name a genuine factory's edge in FACTORY_EDGES.", *(edge(a, b) for a, b in steps)]
    others = [edge(a, b) for a in inside for b in sorted(inside[a]) if (a, b) not in steps]
    if others:
        text += ["The other imports among these modules:", *others]
    return "\n".join(text)


@pytest.mark.parametrize("package", PACKAGE_DIRS)
def test_no_import_circle_counting_imports_inside_functions(package: str) -> None:
    top = package.split(".")[0]
    edges = {m: {t: line for t, line in targets.items() if (m, t) not in FACTORY_EDGES}
             for m, targets in late_graph(top).items()}
    assert len(edges) > 10 and any(edges.values()), "the graph was not built"
    found = [k for k in knots(edges) if innermost_package(k, PACKAGE_DIRS) == package]
    assert not found, "\n\n".join(describe_knot(edges, k) for k in found)


def test_each_factory_edge_is_an_import_inside_a_function_that_closes_a_circle() -> None:
    for (here, there), why in FACTORY_EDGES.items():
        top = here.split(".")[0]
        assert there in late_graph(top).get(here, {}), f"{here} no longer imports {there} ({why}): remove its exemption"
        assert there not in graph(top)[here], f"{here} imports {there} at its top level: {why} is no factory"
        assert here in reachable(late_graph(top), there), f"{here} -> {there} closes no circle: remove its exemption"


def test_the_late_check_finds_a_circle_through_a_function_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\n\n\ndef f():\n    from pkg.b import g\n\n\n"
                      "if __name__ == '__main__':\n    import pkg.c\n")
    assert top_level_imports(module) == {"os": 1}
    assert runtime_imports(module) == {"os": 1, "pkg.b": 5, "pkg.b.g": 5}
    edges: Edges = {"pkg.a": {"pkg.b": 5}, "pkg.b": {"pkg.sub.c": 2}, "pkg.sub.c": {"pkg.a": 9, "pkg.sub.d": 3},
                    "pkg.sub.d": {"pkg.sub.c": 4}, "pkg.e": {"pkg.a": 1}}
    assert knots(edges) == [{"pkg.a", "pkg.b", "pkg.sub.c", "pkg.sub.d"}]
    packages = {"pkg", "pkg.sub"}
    assert innermost_package({"pkg.sub.c", "pkg.sub.d"}, packages) == "pkg.sub"
    assert innermost_package(knots(edges)[0], packages) == "pkg"
    assert innermost_package({"pkg.x.c", "pkg.x.d"}, packages) == "pkg"  # pkg/x/ has no __init__.py
    assert describe_knot(edges, knots(edges)[0]).splitlines()[1:] == [
        "  pkg.a -> pkg.b  (pkg/a.py:5)", "  pkg.b -> pkg.sub.c  (pkg/b.py:2)",
        "  pkg.sub.c -> pkg.a  (pkg/sub/c.py:9)",
        "The other imports among these modules:",
        "  pkg.sub.c -> pkg.sub.d  (pkg/sub/c.py:3)", "  pkg.sub.d -> pkg.sub.c  (pkg/sub/d.py:4)"]


# -- sizes: a module a reader can hold ---------------------------------------------------------------------------------

MAX_LINES = 400
#: Files allowed over MAX_LINES, each with why (a file being split is not exempted: its test fails until it is).
LONG_FILES: dict[str, str] = {}


def long_files(folder: Path, limit: int = MAX_LINES) -> dict[Path, int]:
    """The ``.py`` files below ``folder`` over ``limit`` lines, with their lengths."""
    lengths = {path: len(path.read_text().splitlines()) for path in sorted(folder.rglob("*.py"))}
    return {path: n for path, n in lengths.items() if n > limit}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_over_max_lines(package: str) -> None:
    long = {str(p.relative_to(ROOT)): n for p, n in long_files(ROOT / package).items()}
    over = {p: n for p, n in long.items() if p not in LONG_FILES}
    assert not over, (f"over {MAX_LINES} lines: {over}; split each into modules of one concept (or, if it must "
                      f"stay whole, add it to LONG_FILES with why)")
    stale = [p for p in LONG_FILES if p.startswith(package + "/") and p not in long]
    assert not stale, f"LONG_FILES names files no longer over {MAX_LINES} lines: {stale}; remove them"


def test_the_size_check_finds_a_long_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * 5)
    (tmp_path / "short.py").write_text("x = 1\n" * 4)
    assert long_files(tmp_path, limit=4) == {tmp_path / "sub" / "long.py": 5}
