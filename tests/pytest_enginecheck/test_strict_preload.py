"""Strict mode and the warm parent's preload: a preloaded module is never imported again in a check child, so
the queries its import made are remembered and blamed on whatever imports it (``guard.remember_preload_queries``,
used by the vLLM target's preload); engine_ref's warm parent preloads only modules that make none."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_enginecheck import guard
from pytest_enginecheck.checks import CHECKS
from pytest_enginecheck.guard import CudaGuard, remember_preload_queries
from pytest_enginecheck.session import CHILD_MODULES
from pytest_enginecheck.targets.engine_ref import EngineRefTarget


@pytest.fixture
def shared_helper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package ``ecsp`` whose shared helper queries CUDA at import, and two model modules: one importing it."""
    package = tmp_path / "ecsp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "probe.py").write_text("import torch\n\nHAS_GPU = torch.cuda.is_available()\n")
    (package / "model.py").write_text("from ecsp import probe  # noqa: F401\n")
    (package / "other.py").write_text("import json  # noqa: F401\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(guard, "_preload_queries", {})
    yield "ecsp"
    for name in [n for n in sys.modules if n == "ecsp" or n.startswith("ecsp.")]:
        del sys.modules[name]


def _preload(name: str) -> list[guard.CudaAccess]:
    """What the vLLM target's warm parent does with a preloaded module under the strict guard."""
    with CudaGuard(strict=True) as preload_guard:
        importlib.import_module(name)
    remember_preload_queries(preload_guard.accesses)
    return preload_guard.accesses


def test_a_preloaded_helpers_query_is_blamed_on_its_importer(shared_helper: str) -> None:
    (query,) = _preload("ecsp.probe")
    with CudaGuard(strict=True) as child:
        importlib.import_module("ecsp.model")
        importlib.import_module("ecsp.other")
    (blamed,) = child.accesses
    assert (blamed.api, blamed.kind, Path(blamed.file or "").name, blamed.line) == (
        "torch.cuda.is_available", "query", "probe.py", 3)
    assert blamed.chain == ["ecsp.model", "ecsp.probe"]
    assert query.chain == ["ecsp.probe"]


def test_without_strict_or_without_importing_it_nothing_is_blamed(shared_helper: str) -> None:
    _preload("ecsp.probe")
    with CudaGuard() as plain:
        importlib.import_module("ecsp.model")
    with CudaGuard(strict=True) as strict:
        importlib.import_module("ecsp.other")
    assert plain.accesses == [] and strict.accesses == []


def test_engine_refs_warm_parent_preloads_nothing_that_queries_cuda() -> None:
    """engine_ref's warm parent imports engine_ref.warmup and the plugin's child modules unguarded (never a model
    or plugin module): strict would not see a query there, so none may be made."""
    script = (
        "import importlib, json, sys\n"
        "import torch\n"
        "from pytest_enginecheck.guard import CudaGuard\n"
        "with CudaGuard(strict=True) as g:\n"
        "    for name in sys.argv[1:]:\n"
        "        importlib.import_module(name)\n"
        "print(json.dumps([a.describe() for a in g.accesses]))\n")
    out = subprocess.run([sys.executable, "-c", script, "engine_ref.warmup", *CHILD_MODULES,
                          *EngineRefTarget("engine_ref").warm_parent_modules(CHECKS)],
                         capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_torch_dynamo_is_preloaded_only_for_the_checks_that_run_the_memory_estimate() -> None:
    """Its import costs ~1 s in every warm parent; engine startup never needs it (tests/engine_ref/test_warmup.py),
    the estimate's fake tensors do, and without the preload each check child that estimates would import it."""
    target = EngineRefTarget("engine_ref")
    for checks in [("import", "inspect", "load", "startup", "lora"), ("plugins",)]:
        assert "torch._dynamo" not in target.warm_parent_modules(checks), checks
    for checks in [("budget",), ("quant",), ("import", "load", "budget", "startup")]:
        assert "torch._dynamo" in target.warm_parent_modules(checks), checks
