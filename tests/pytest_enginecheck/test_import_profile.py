"""The import profile: ImportProfiler on real modules, its report lines, and ``--enginecheck-import-profile`` in a
plugin run whose model pulls in a helper that sleeps at import."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_enginecheck.import_profile import PROFILE_TOP, ImportProfiler, _bootstrap
from pytest_enginecheck.report import import_profile_lines

SLEEP_S = 0.3  # what the helper's import costs: far above any other module's here


@pytest.fixture
def write_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[dict[str, str]], str]]:
    """``write_package({module: source}) -> package``: a uniquely named package on sys.path, ``PKG`` in the sources
    replaced by its name (its modules leave sys.modules after the test)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(modules: dict[str, str]) -> str:
        package = f"profiled_{uuid.uuid4().hex[:8]}"
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        for name, source in modules.items():
            (tmp_path / package / f"{name}.py").write_text(textwrap.dedent(source).replace("PKG", package))
        importlib.invalidate_caches()
        written.append(package)
        return package

    yield write
    for name in [m for m in sys.modules if m.split(".")[0] in written]:
        del sys.modules[name]


# A model module that imports a light module and a helper that sleeps SLEEP_S at import.
SLEEPY = {"model": "import PKG.light\nimport PKG.helper\nclass Model: ...\n", "light": "X = 1\n",
          "helper": f"import time\ntime.sleep({SLEEP_S})\n"}


def test_the_sleeping_helper_tops_the_profile_with_its_chain(write_package: Callable[[dict[str, str]], str]) -> None:
    package = write_package(SLEEPY)
    with ImportProfiler() as profiler:
        importlib.import_module(f"{package}.model")
    top = profiler.top(root=f"{package}.model")
    assert top[0]["module"] == f"{package}.helper"
    assert top[0]["chain"] == [f"{package}.model", f"{package}.helper"]
    assert SLEEP_S <= top[0]["self_s"] <= top[0]["cumulative_s"] < SLEEP_S + 1
    model = next(e for e in top if e["module"] == f"{package}.model")
    # the model's cumulative time holds the helper's; its self time does not
    assert model["cumulative_s"] >= top[0]["cumulative_s"] > model["self_s"]
    assert {e["module"] for e in top} == {package, f"{package}.model", f"{package}.light", f"{package}.helper"}
    assert [e["self_s"] for e in top] == sorted((e["self_s"] for e in top), reverse=True)
    assert profiler.total_s() == pytest.approx(model["cumulative_s"], abs=1e-5)  # the one outermost import


def test_loaded_modules_other_threads_and_the_hook_after_the_block(
        write_package: Callable[[dict[str, str]], str]) -> None:
    package = write_package({"a": "", "b": "", "c": ""})
    importlib.import_module(f"{package}.a")
    original = _bootstrap._find_and_load
    with ImportProfiler() as profiler:
        assert _bootstrap._find_and_load != original
        importlib.import_module(f"{package}.a")  # already loaded: not an import
        thread = threading.Thread(target=importlib.import_module, args=(f"{package}.b",))
        thread.start()
        thread.join(10)
        importlib.import_module(f"{package}.c")
    assert _bootstrap._find_and_load == original
    assert [r.module for r in profiler.records] == [f"{package}.c"]
    assert f"{package}.b" in sys.modules  # the other thread's import ran, untimed


def test_an_import_that_raises_is_recorded_and_the_hook_restored(
        write_package: Callable[[dict[str, str]], str]) -> None:
    package = write_package({"bad": "import json\nraise RuntimeError('at import')\n"})
    original = _bootstrap._find_and_load
    with pytest.raises(RuntimeError, match="at import"), ImportProfiler() as profiler:
        importlib.import_module(f"{package}.bad")
    assert _bootstrap._find_and_load == original
    assert f"{package}.bad" in [r.module for r in profiler.records]


def test_profilers_nest(write_package: Callable[[dict[str, str]], str]) -> None:
    package = write_package({"a": "", "b": ""})
    with ImportProfiler() as outer:
        importlib.import_module(f"{package}.a")
        with ImportProfiler() as inner:
            importlib.import_module(f"{package}.b")
    assert [r.module for r in inner.records] == [f"{package}.b"]
    assert {r.module for r in outer.records} == {package, f"{package}.a", f"{package}.b"}
    with pytest.raises(RuntimeError, match="entered twice"), outer, outer:
        pass


def test_top_keeps_the_slowest_n() -> None:
    profiler = ImportProfiler()
    from pytest_enginecheck.import_profile import ModuleTime

    profiler.records = [ModuleTime(f"m{i}", i / 1000, i / 1000, ("root", f"m{i}")) for i in range(40)]
    top = profiler.top(root="root")
    assert len(top) == PROFILE_TOP and top[0] == {"module": "m39", "self_s": 0.039, "cumulative_s": 0.039,
                                                   "chain": ["root", "m39"]}
    assert profiler.top(3, root="m39")[0]["chain"] == ["m39"]  # the chain starts at the root


def result(arch: str, profile: list[dict[str, Any]], outcome: str = "passed") -> dict[str, Any]:
    return {"arch": arch, "check": "import", "outcome": outcome, "duration_s": 0.1, "phases": {"check": 0.5},
            "message": "", "detail": {"import_seconds": 0.5, "import_profile": profile}}


def entry(module: str, self_s: float, *chain: str) -> dict[str, Any]:
    return {"module": module, "self_s": self_s, "cumulative_s": self_s, "chain": [*chain, module]}


def test_profile_lines_per_architecture_then_summed() -> None:
    results = [result("B", [entry("heavy", 0.4, "b"), entry("b", 0.1)]),
               result("A", [entry("heavy", 0.3, "a", "mid"), entry("a", 0.2), entry("mid", 0.05, "a")], "failed"),
               {**result("A", []), "check": "inspect"}]
    assert import_profile_lines(results, 2) == [
        "A: importing its module took 0.500 s (failed); slowest modules (self, cumulative):",
        "     0.300 s     0.300 s  heavy  (chain: a -> mid -> heavy)",
        "     0.200 s     0.200 s  a",
        "B: importing its module took 0.500 s; slowest modules (self, cumulative):",
        "     0.400 s     0.400 s  heavy  (chain: b -> heavy)",
        "     0.100 s     0.100 s  b",
        "Modules that cost the most summed over 2 architectures (self time, from each import's slowest modules):",
        "     0.700 s  heavy  (imported by 2 architectures)",
        "     0.200 s  a  (imported by 1 architecture)",
    ]
    assert import_profile_lines([], 5) == []


SLEEPY_TARGET = {
    "targets.py": 'MODELS = {"SleepyForCausalLM": "sleepy.model:SleepyForCausalLM"}\n',
    "sleepy/__init__.py": "",
    "sleepy/model.py": "import json\nimport sleepy.helper\nclass SleepyForCausalLM: ...\n",
    "sleepy/helper.py": f"import time\ntime.sleep({SLEEP_S})\n",
}


def test_plugin_run_profiles_the_sleeping_helper(pytester: pytest.Pytester) -> None:
    """``--enginecheck-import-profile``: the helper that sleeps at import tops the profile, in the JSON report and
    in the terminal, with the chain from the model's module; the summed view names it too."""
    for name, source in SLEEPY_TARGET.items():
        (pytester.path / name).parent.mkdir(parents=True, exist_ok=True)
        (pytester.path / name).write_text(source)
    pytester.makeini("[pytest]\npythonpath = .\n")
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", "-m", "enginecheck",
                                           "--enginecheck-target=targets:MODELS", "--enginecheck-checks=import",
                                           "--enginecheck-import-profile=3", f"--enginecheck-json={report}",
                                           timeout=300)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    (found,) = json.loads(report.read_text())["results"]
    profile = found["detail"]["import_profile"]
    assert profile[0]["module"] == "sleepy.helper" and profile[0]["chain"] == ["sleepy.model", "sleepy.helper"]
    assert profile[0]["self_s"] >= SLEEP_S
    assert {"module", "self_s", "cumulative_s", "chain"} == set(profile[0])
    result.stdout.fnmatch_lines([
        "*= enginecheck import profile =*",
        "SleepyForCausalLM: importing its module took * s; slowest modules (self, cumulative):",
        "     * s     * s  sleepy.helper  (chain: sleepy.model -> sleepy.helper)",
        "Modules that cost the most summed over 1 architecture *",
        "     * s  sleepy.helper  (imported by 1 architecture)",
    ])
    # the figures printed are the profile's, at least the sleep (how much more depends on the machine's load)
    printed = [float(line.split()[0]) for line in result.outlines
               if line.endswith("sleepy.helper  (imported by 1 architecture)")]
    assert printed == [pytest.approx(profile[0]["self_s"], abs=1e-3)] and printed[0] >= SLEEP_S, printed


def test_import_profile_option_is_validated(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", "--co",
                                           "--enginecheck-import-profile=many", timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--enginecheck-import-profile='many': give a number of modules, e.g. 10*"])
