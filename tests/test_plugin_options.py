"""The plugin's options: loading it stays light, each flag has an ini twin that the flag overrides,
and bad values are usage errors that say what to pass instead."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ZOO = Path(__file__).parent / "plugin_zoo"


@pytest.fixture
def zoo(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytester's directory holding the zoo package (``zoo:MODELS``, ``zoo.registry:REGISTRY``).

    Describing a target imports no torch, so these runs fork their children straight from pytest
    instead of starting the warm parent (which would import torch for nothing).
    """
    shutil.copytree(ZOO, pytester.path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("ENGINE_REF_WORKER_MULTIPROC_METHOD", "fork")
    return pytester


def test_loading_the_plugin_imports_neither_torch_nor_the_engine() -> None:
    code = "import sys, json; import pytest_enginecheck.plugin; print(json.dumps(sorted(sys.modules)))"
    modules = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                        text=True).stdout)
    assert "pytest_enginecheck.plugin" in modules
    heavy = [m for m in modules if m.split(".")[0] in ("torch", "safetensors", "transformers", "numpy")
             or m.startswith(("engine_ref.engine", "engine_ref.model_executor", "engine_ref.executor",
                              "engine_ref.worker", "engine_ref.warmup", "engine_ref.isolation"))]
    assert heavy == []


def test_a_plain_pytest_run_stays_light(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_light="""
        import sys

        def test_nothing_heavy_was_imported():
            assert [m for m in sys.modules if m == "torch" or m.startswith("engine_ref")] == []
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers", timeout=120)
    result.assert_outcomes(passed=1)


INI = """
[pytest]
pythonpath = .
enginecheck = true
enginecheck_target = zoo.registry:REGISTRY
enginecheck_checks = import,load
enginecheck_tp = 2
"""
REGISTRY_ARCHS = ("BadShardLlamaForCausalLM", "TempLeakLlamaForCausalLM", "ProcessLeakLlamaForCausalLM")


def collected(result: pytest.RunResult) -> list[str]:
    """The node ids ``--collect-only -q`` listed."""
    return [line for line in result.outlines if line.startswith("enginecheck::")]


def test_ini_options_work_like_flags_and_flags_win(zoo: pytest.Pytester) -> None:
    zoo.makeini(INI)
    from_ini = zoo.runpytest_subprocess("-p", "no:cacheprovider", "--collect-only", "-q", timeout=120)
    assert from_ini.ret == 0, from_ini.stdout.str() + from_ini.stderr.str()
    assert collected(from_ini) == [f"enginecheck::{arch}::{check}" for arch in REGISTRY_ARCHS
                                   for check in ("import", "load[tp=2]")]

    from_cli = zoo.runpytest_subprocess("-p", "no:cacheprovider", "--collect-only", "-q",
                                        "--enginecheck-checks=load", "--enginecheck-tp=1", timeout=120)
    assert from_cli.ret == 0, from_cli.stdout.str() + from_cli.stderr.str()
    assert collected(from_cli) == [f"enginecheck::{arch}::load[tp=1]" for arch in REGISTRY_ARCHS]


@pytest.mark.parametrize(("args", "ini", "message"), [
    pytest.param(["--enginecheck-tp=0"], "",
                 "ERROR: --enginecheck-tp='0': give positive integers, e.g. 1,2", id="tp-zero"),
    pytest.param(["--enginecheck-tp=1,two"], "",
                 "ERROR: --enginecheck-tp='1,two': give positive integers, e.g. 1,2", id="tp-word"),
    pytest.param(["--enginecheck-timeout=-1"], "",
                 "ERROR: --enginecheck-timeout='-1': give a positive number of seconds", id="timeout-negative"),
    pytest.param([], "enginecheck_timeout = soon",
                 "ERROR: --enginecheck-timeout='soon': give a positive number of seconds", id="timeout-ini"),
    pytest.param(["--enginecheck-checks=import,bogus"], "",
                 "ERROR: --enginecheck-checks: unknown check(s) bogus; choose from "
                 "import,inspect,load,budget,startup", id="checks-unknown"),
    pytest.param(["--enginecheck-device-memory=8gigs"], "",
                 "ERROR: --enginecheck-device-memory='8gigs' is not a size; write a number with a unit such as "
                 "'8GiB'*", id="device-memory"),
    pytest.param(["--enginecheck-target=nonexistent_module_xyz:MODELS"], "",
                 "ERROR: --enginecheck-target='nonexistent_module_xyz:MODELS': cannot import "
                 "'nonexistent_module_xyz' (No module named 'nonexistent_module_xyz'). Is it on sys.path?*",
                 id="target-module-missing"),
    pytest.param(["--enginecheck-target=zoo:NO_SUCH_ATTRIBUTE"], "",
                 "ERROR: --enginecheck-target='zoo:NO_SUCH_ATTRIBUTE': module 'zoo' has no 'NO_SUCH_ATTRIBUTE'",
                 id="target-attribute-missing"),
    pytest.param(["--enginecheck-target=zoo"], "",
                 "ERROR: --enginecheck-target='zoo' is not a target: use 'engine_ref', 'vllm', or "
                 "'module:attribute'*", id="target-no-colon"),
    pytest.param(["--enginecheck-target=zoo:NOT_A_MAPPING"], "",
                 "ERROR: --enginecheck-target='zoo:NOT_A_MAPPING' names a list; it must be a mapping of "
                 "architecture -> 'module:Class' or an engine_ref ModelRegistry.", id="target-wrong-type"),
    pytest.param(["--enginecheck-target=zoo:MODELS", "--enginecheck-checks=import,load"], "",
                 "ERROR: --enginecheck-checks: load cannot run on a mapping target (only import, inspect); "
                 "point --enginecheck-target at an engine_ref ModelRegistry.", id="mapping-target-load"),
])
def test_bad_values_are_usage_errors(zoo: pytest.Pytester, args: list[str], ini: str, message: str) -> None:
    zoo.makeini(f"[pytest]\npythonpath = .\n{ini}\n")
    zoo.makepyfile(test_never_runs="def test_never_runs():\n    raise AssertionError('ran despite a usage error')\n")
    result = zoo.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", *args, timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines([message])
    assert "Traceback" not in result.stderr.str() + result.stdout.str()
    assert "ran despite a usage error" not in result.stdout.str()
