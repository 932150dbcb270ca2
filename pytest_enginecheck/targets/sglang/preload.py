"""What the warm parent preloads for the SGLang target, found from SGLang's own model modules.

Each model module imports, besides its own code, a large common part of SGLang (its layers, the batch
and scheduler types, the OpenAI protocol, ``triton_kernels``...): ~1.7 s per fork when only the layers
every model names are loaded, ~0.25 s once that common part is. It is derived in a fresh interpreter
(``python -m pytest_enginecheck.targets.sglang.preload``): the ``sglang.*`` modules that at least
``share`` of the model modules import by name (read from their ASTs) are imported, then a sample of
model modules each in its own fork under the CUDA guard, and every module at least ``share`` of the
sample pulls in is counted. The answer, every module so found except SGLang's model modules
themselves, is cached on disk per SGLang install; ``warm`` imports it under the guard and drops what
trips it. Nothing here is a hand-kept list.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import json
import os
import sys
from collections import Counter
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pytest_enginecheck.targets.preloading import derived_names
from pytest_enginecheck.targets.sglang.discovery import IN_TREE_PACKAGE, ModelModule, discover, package_paths

# The warm parent's preload, read by ``warm``: a JSON file's path (the list is thousands of names, too long for a
# variable: exec refuses an environment string over 128 KiB).
PRELOAD_VARIABLE = "ENGINECHECK_SGLANG_PRELOAD"
PRELOAD_STRICT_VARIABLE = "ENGINECHECK_SGLANG_PRELOAD_STRICT"  # "1": preload under the strict guard
DERIVE_TIMEOUT_S = 300.0


def named_imports(path: str) -> set[str]:
    """The absolute ``sglang.*`` modules a source file imports at its top level (``import m``, ``from m import``)."""
    tree = ast.parse(Path(path).read_bytes(), filename=path)
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.startswith("sglang.")}


def shared_names(modules: list[ModelModule], share: float) -> list[str]:
    """The non-model ``sglang.*`` modules at least ``share`` of ``modules`` import by name."""
    own = {m.name for m in modules}
    counts: Counter[str] = Counter()
    for module in modules:
        counts.update(n for n in named_imports(module.path) if n not in own)
    return sorted(name for name, n in counts.items() if n >= share * len(modules))


def _fork_import(name: str) -> list[str] | None:
    """Import ``name`` in a fork under the guard: the modules it added, None if it failed or touched CUDA."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        from pytest_enginecheck.guard import CudaGuard

        before = set(sys.modules)
        added: list[str] | None = None
        try:
            with CudaGuard() as guard:
                importlib.import_module(name)
            added = None if guard.accesses else sorted(set(sys.modules) - before)
        except BaseException:  # noqa: BLE001 - a failing module is not counted
            added = None
        with os.fdopen(write, "w") as out:
            json.dump(added, out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        text = answer.read()
    os.waitpid(pid, 0)
    try:
        found = json.loads(text)
    except ValueError:
        return None
    return found if isinstance(found, list) else None


def derive_preload(sample_size: int = 32, share: float = 0.3) -> list[str]:
    """Run in a throwaway interpreter: see the module docstring."""
    modules = discover(IN_TREE_PACKAGE)
    own = {m.name for m in modules}
    before = set(sys.modules)
    for name in shared_names(modules, share):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - left to the checks that import it
            continue
    base = set(sys.modules) - before
    with_entries = [m for m in modules if m.classes]
    step = max(1, len(with_entries) // sample_size)
    sample = [m.name for m in with_entries[::step][:sample_size]]
    counts: Counter[str] = Counter()
    imported = 0
    for name in sample:
        added = _fork_import(name)
        if added is not None:
            imported += 1
            counts.update(added)
    common = {name for name, n in counts.items() if n >= share * max(imported, 1)}
    return sorted(name for name in base | common if name not in own)


def cache_key() -> str:
    """The installed SGLang's version and its model package's file list and sizes, computed without importing it."""
    try:
        installed = version("sglang")
    except PackageNotFoundError:
        installed = "unknown"
    digest = hashlib.sha256(sys.version.encode())
    try:
        for path in package_paths(IN_TREE_PACKAGE):
            for entry in sorted(Path(path).glob("*.py")):
                digest.update(f"{entry.name}:{entry.stat().st_size}".encode())
    except Exception:  # noqa: BLE001 - no SGLang: a key of its own, and an empty preload
        return "no-sglang"
    return f"sglang-{installed}-{digest.hexdigest()[:16]}"


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/pytest-enginecheck`` (``~/.cache/pytest-enginecheck``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pytest-enginecheck"


def read_preload(path: str) -> list[str]:
    """The module names of a preload file (none when it cannot be read)."""
    try:
        names = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def preload_file(timeout: float = DERIVE_TIMEOUT_S) -> str | None:
    """The derived preload's file, from the on-disk cache or derived now in a fresh interpreter (then cached). A
    derivation that fails or times out gives none: each check then imports what it needs (slower, same
    verdicts)."""
    key = cache_key()
    if key == "no-sglang":
        return None
    path = cache_dir() / f"sglang-preload-{key}.json"
    return str(path) if derived_names(path, __name__, timeout) else None


if __name__ == "__main__":
    print(json.dumps(derive_preload()))
