"""The plugin's options: loading it stays light, each flag has an ini twin that the flag overrides,
and bad values are usage errors that say what to pass instead."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_enginecheck.checks import CHECKS, TP_CHECKS

ZOO = Path(__file__).parents[1] / "plugin_zoo"


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
    *[pytest.param([f"--enginecheck-timeout={value}"], "",
                   f"ERROR: --enginecheck-timeout='{value}': give a finite positive number of seconds",
                   id=f"timeout-{value}") for value in ("-1", "0", "inf", "nan", "-inf")],
    # a bad ini value is named as the ini option it came from
    pytest.param([], "enginecheck_timeout = soon",
                 "ERROR: ini option enginecheck_timeout='soon': give a finite positive number of seconds",
                 id="timeout-ini"),
    pytest.param([], "enginecheck_tp = 1,two",
                 "ERROR: ini option enginecheck_tp='1,two': give positive integers, e.g. 1,2", id="tp-ini"),
    pytest.param([], "enginecheck_device_memory = lots",
                 "ERROR: ini option enginecheck_device_memory='lots' is not a size*", id="device-memory-ini"),
    pytest.param([], "enginecheck_summary = most",
                 "ERROR: ini option enginecheck_summary='most': choose from all, failures, none", id="summary-ini"),
    pytest.param(["--enginecheck-summary=most"], "",
                 "*--enginecheck-summary: invalid choice: 'most'*",
                 id="summary-flag"),
    # a target's own option (Target.options) is refused as the core's are, whichever target runs
    pytest.param([], "enginecheck_inspect = spawn",
                 "ERROR: ini option enginecheck_inspect='spawn': choose from fork, subprocess", id="inspect-ini"),
    pytest.param(["--enginecheck-inspect=spawn"], "",
                 "*--enginecheck-inspect: invalid choice: 'spawn' (choose from 'fork', 'subprocess')*",
                 id="inspect-flag"),
    pytest.param(["--enginecheck-budget-memory=big"], "",
                 "ERROR: --enginecheck-budget-memory='big' is not a size*", id="budget-memory"),
    *[pytest.param([f"--enginecheck-budget-utilization={value}"], "",
                   f"ERROR: --enginecheck-budget-utilization='{value}': give a fraction in (0, 1], e.g. 0.9",
                   id=f"budget-utilization-{value}") for value in ("1.5", "0", "nan")],
    pytest.param([], "enginecheck_budget_max_model_len = 0",
                 "ERROR: ini option enginecheck_budget_max_model_len='0': give a positive number of tokens, e.g. 128",
                 id="budget-max-model-len-ini"),
    # the JSON report's path is checked before anything runs
    pytest.param(["--enginecheck-json=zoo"], "",
                 "ERROR: --enginecheck-json='zoo': it is a directory; give a file path, e.g. enginecheck.json",
                 id="json-directory"),
    pytest.param(["--enginecheck-json=afile/report.json"], "",
                 "ERROR: --enginecheck-json='afile/report.json': cannot write there (*); give a writable file path",
                 id="json-under-a-file"),
    pytest.param(["--enginecheck-checks=import,bogus"], "",
                 f"ERROR: --enginecheck-checks: unknown check(s) bogus; choose from {','.join(CHECKS)}",
                 id="checks-unknown"),
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
                 "ERROR: --enginecheck-target='zoo' is not a target: use one of 'engine_ref', 'sglang', 'vllm' (the "
                 "entry points of pytest_enginecheck.targets), or 'module:attribute'*", id="target-no-colon"),
    pytest.param(["--enginecheck-target=zoo:NOT_A_MAPPING"], "",
                 "ERROR: --enginecheck-target='zoo:NOT_A_MAPPING' names a list; it must be a mapping of "
                 "architecture -> 'module:Class' or an engine_ref ModelRegistry.", id="target-wrong-type"),
    pytest.param(["--enginecheck-target=zoo:MODELS", "--enginecheck-checks=import,load"], "",
                 "ERROR: --enginecheck-checks: load cannot run on a mapping target (only import, inspect): load: a "
                 "mapping of architecture -> 'module:Class' has no engine to build it with; point "
                 "--enginecheck-target at an engine_ref ModelRegistry.", id="mapping-target-load"),
])
def test_bad_values_are_usage_errors(zoo: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                     args: list[str], ini: str, message: str) -> None:
    zoo.makeini(f"[pytest]\npythonpath = .\n{ini}\n")
    zoo.makepyfile(test_never_runs="def test_never_runs():\n    raise AssertionError('ran despite a usage error')\n")
    (zoo.path / "afile").write_text("a file, not a directory\n")
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    result = zoo.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", *args, timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines([message])
    assert "Traceback" not in result.stderr.str() + result.stdout.str()
    assert "ran despite a usage error" not in result.stdout.str()
    # nothing left behind: no report or its temp file, no session temp dir
    assert [p.name for p in zoo.path.rglob("*") if p.name.endswith((".tmp", ".json"))] == []
    assert list(private_tmp.iterdir()) == []


def test_help_says_what_each_option_and_marker_does(pytester: pytest.Pytester) -> None:
    helped = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--help", timeout=120)
    text = " ".join(helped.stdout.str().split())  # argparse wraps the help text
    assert f"one item per size for each of the {', '.join(TP_CHECKS)} checks" in text
    for flag in ("--enginecheck-summary={all,failures,none}", "--enginecheck-budget-memory=SIZE",
                 "--enginecheck-budget-utilization=FRACTION", "--enginecheck-budget-max-model-len=TOKENS",
                 "--enginecheck-inspect={fork,subprocess}"):
        assert flag in text
    assert "(full fidelity, ~15 s each) (default: fork); read by the inspect check" in text  # a target's own
    markers = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--markers", timeout=120)
    markers.stdout.fnmatch_lines(["@pytest.mark.memory_budget(per_rank): * (needs the engine fixture: *",
                                  "@pytest.mark.world_size(n): * needs the multirank fixture)"])
