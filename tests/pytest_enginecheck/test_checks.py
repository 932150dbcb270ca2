"""``pytest --enginecheck`` end to end: the checks over a zoo of broken models (tests/plugin_zoo), the
bundled zoo, and the same results under pytest-xdist. Few, fat subprocess runs; each one's JSON report
is then read item by item.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from pytest_enginecheck.report import summary_mode, summary_table
from tests.helpers import alive, install_engine_ref_plugin, zoo_loader
from tests.zoo_sessions import ROOT_CAUSES, TP_DIAGNOSIS, ZooSession, zoo_session

# the fixture that reads a shared zoo session -> its name (started early: tests/zoo_sessions.py)
ZOO_SESSIONS = {"root_causes": "root-causes", "tp_diagnosis": "tp-diagnosis"}

ZOO = Path(__file__).parents[1] / "plugin_zoo"
MODELS: dict[str, str] = runpy.run_path(str(ZOO / "zoo" / "__init__.py"))["MODELS"]
CHECKS = "--enginecheck-checks=import,inspect,load,startup"  # the bundled zoo's, budget aside
TIMEOUT = 4  # --enginecheck-timeout of the broken zoo runs: the hanging module costs this, twice
RESULT_KEYS = {"arch", "check", "outcome", "duration_s", "phases", "message", "detail"}
BUNDLED = ["LlamaForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
           "LlavaForConditionalGeneration"]
BUNDLED_CHECKS = ["import", "inspect", "load[tp=1]", "load[tp=2]", "startup"]

Results = dict[tuple[str, str], dict[str, Any]]


FOREIGN = "foreign_engine_ref_plugin"


def install_foreign_plugin(site: Path) -> Path:
    """Lay out, in ``site``, another distribution's engine_ref plugin (as a user's environment may hold one):
    it registers one more architecture."""
    return install_engine_ref_plugin(site, FOREIGN, "foreign", """
        from engine_ref.model_executor.models.registry import ModelRegistry
        ModelRegistry.register_model('ForeignVendorForCausalLM',
                                     'engine_ref.model_executor.models.llama:LlamaForCausalLM')
    """)


@pytest.fixture(autouse=True)
def hermetic(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs see another engine_ref plugin installed, as a user's environment may hold one, and load none:
    the default target is the bundled zoo alone."""
    site = install_foreign_plugin(tmp_path_factory.mktemp("foreign-site"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("ENGINE_REF_PLUGINS", "")


@pytest.fixture
def zoo(pytester: pytest.Pytester) -> pytest.Pytester:
    """pytester's directory holding the zoo package, importable by the checks' processes."""
    shutil.copytree(ZOO, pytester.path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    pytester.makeini("[pytest]\npythonpath = .\n")
    return pytester


def run_enginecheck(pytester: pytest.Pytester, *args: str, name: str = "report") -> tuple[pytest.RunResult, Results]:
    """One ``pytest --enginecheck`` subprocess run; its JSON results by (arch, check)."""
    path = pytester.path / f"{name}.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", f"--enginecheck-json={path}",
                                           *args, timeout=420)
    assert path.exists(), result.stdout.str() + result.stderr.str()
    target = next((a.split("=", 1)[1] for a in args if a.startswith("--enginecheck-target=")), "engine_ref")
    return result, validated(json.loads(path.read_text()), target)


def validated(report: dict[str, Any], target: str) -> Results:
    """A JSON report's results by (arch, check), once each has the fields and the timings every result has."""
    assert (set(report), report["version"], report["target"]) == ({"version", "target", "cache", "results"}, 1, target)
    for r in report["results"]:
        assert set(r) == RESULT_KEYS, r
        assert r["outcome"] in ("passed", "failed", "skipped") and isinstance(r["message"], str)
        assert isinstance(r["duration_s"], float) and r["duration_s"] >= 0 and isinstance(r["detail"], dict)
        # where the time went: the child process around the check, the check (when the child answered), the
        # phases of the engine it started
        assert "process" in r["phases"] and all(v >= 0 for v in r["phases"].values()), r
        assert r["phases"]["process"] + r["phases"].get("check", 0) == pytest.approx(r["duration_s"], abs=2e-4), r
        assert (r["message"] == "") == (r["outcome"] == "passed"), r
    results = {(r["arch"], r["check"]): r for r in report["results"]}
    assert len(results) == len(report["results"]), "one result per item"
    return results


def glob(text: str) -> str:
    """``text`` as an fnmatch pattern whose ``[`` are literal (``*`` stays a wildcard)."""
    return text.replace("[", "[[]")


def unwrapped(result: pytest.RunResult) -> str:
    """The run's output with the lines the plugin wrapped to the terminal's width joined back (by one space)."""
    return " ".join(line.strip() for line in result.outlines)


def section(output: str, title: str) -> str:
    """The text of the FAILURES section of a pytest run whose header holds ``title``."""
    after = output.split(f" {title} _", 1)[1].split("\n", 1)[1]
    return re.split(r"^(?:_{3,} .+ _{3,}|={3,}.*={3,})$", after, maxsplit=1, flags=re.M)[0].strip()


def line_of(path: Path, needle: str) -> int:
    """The 1-based number of the line of ``path`` that contains ``needle``."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


# arch -> (module file, the call on the offending line, the API the report names)
CUDA_AT_IMPORT = {
    "ZerosCudaModel": ("cuda_zeros", 'torch.zeros(16, device="cuda")', "torch.zeros"),
    "DotCudaModel": ("cuda_dot_cuda", "torch.ones(8).cuda()", "Tensor.cuda"),
    "ToCudaModel": ("cuda_to", 'torch.ones(8).to("cuda")', "Tensor.to"),
    "SetDeviceModel": ("cuda_set_device", "torch.cuda.set_device(0)", "torch.cuda.set_device"),
    "StreamModel": ("cuda_stream", "torch.cuda.Stream()", "torch.cuda.Stream"),
    "EventModel": ("cuda_event", "torch.cuda.Event()", "torch.cuda.Event"),
    "CurrentDeviceModel": ("cuda_current_device", "torch.cuda.current_device()", "torch.cuda.current_device"),
    "MemGetInfoModel": ("cuda_mem_get_info", "torch.cuda.mem_get_info()", "torch.cuda.mem_get_info"),
    "SwallowsCudaModel": ("swallows_cuda", 'torch.empty(4, device="cuda")', "torch.empty"),
}
INSPECT_PASSES = ["DeviceObjectModel", "UncalledFunctionModel", "GuardedModel", "CachedCapabilityModel",
                  "QueriesAvailableModel", "QueriesDeviceCountModel"]
IMPORT_PASSES = [*INSPECT_PASSES, "NotAModel"]


def assert_import_results(results: Results, zoo_dir: Path) -> None:
    """What the import check says about each module of the broken zoo."""
    seed = results[("SeedVLForConditionalGeneration", "import")]
    offender = zoo_dir / "zoo" / "expert_parallel.py"
    assert seed["outcome"] == "failed"
    assert {k: seed["detail"][k] for k in ("kind", "api", "file", "line", "chain")} == {
        "kind": "cuda", "api": "torch.cuda.get_device_properties", "file": str(offender),
        "line": line_of(offender, "get_device_properties"),
        "chain": ["zoo.seed_vl", "zoo.seed_lm", "zoo.expert_parallel"],
    }
    assert seed["message"].startswith(
        f"Importing zoo.seed_vl touched CUDA: it initialized CUDA: torch.cuda.get_device_properties at "
        f"{offender}:{seed['detail']['line']} (`SM_COUNT = torch.cuda.get_device_properties(0)")
    assert "Import chain: zoo.seed_vl -> zoo.seed_lm -> zoo.expert_parallel." in seed["message"]
    assert "functools.cache" in seed["message"]  # the fix

    for arch, (module, call, api) in CUDA_AT_IMPORT.items():
        r = results[(arch, "import")]
        path = zoo_dir / "zoo" / f"{module}.py"
        assert r["outcome"] == "failed", (arch, r)
        assert (r["detail"]["api"], r["detail"]["file"], r["detail"]["line"], r["detail"]["chain"]) == \
               (api, str(path), line_of(path, call), [f"zoo.{module}"]), arch
        assert r["message"].startswith(f"Importing zoo.{module} touched CUDA: it initialized CUDA: {api} at "), arch

    def failure(arch: str) -> tuple[str, dict[str, Any]]:
        r = results[(arch, "import")]
        assert r["outcome"] == "failed", (arch, r)
        return r["message"], r["detail"]

    message, detail = failure("MissingDependencyModel")
    assert message == ("Importing zoo.missing_dependency failed: it imports 'zoo_fused_kernels_not_installed', "
                       "which is not installed. Install it, or import it lazily inside the code that needs it.")
    assert (detail["kind"], detail["dependency"]) == ("missing_dependency", "zoo_fused_kernels_not_installed")
    message, detail = failure("RaisesModel")
    assert message == ("Importing zoo.raises raised ValueError: rope_scaling type 'zigzag' is not supported by "
                       "this zoo model")
    assert (detail["kind"], detail["exception"]) == ("exception", "ValueError")
    assert f'zoo{os.sep}raises.py", line 3, in <module>' in detail["traceback"]
    message, detail = failure("SegfaultModel")
    assert message.startswith("Importing zoo.segfault crashed the process: it was killed by SIGSEGV.")
    assert (detail["kind"], detail["signal"]) == ("crash", "SIGSEGV")
    message, detail = failure("ExitsModel")
    assert message.startswith("Importing zoo.exits ended the process with exit code 3 ")
    assert (detail["kind"], detail["exit_code"]) == ("exit", 3)
    message, detail = failure("HangsModel")
    assert message.startswith(f"Importing zoo.hangs did not finish within {TIMEOUT} s (--enginecheck-timeout); "
                              f"the check's process tree was killed. Its Python stacks at that moment:\n")
    assert f'zoo{os.sep}hangs.py", line {line_of(zoo_dir / "zoo" / "hangs.py", "time.sleep")} in wait_for_device' \
           in detail["stacks"]
    assert detail["kind"] == "timeout"
    message, detail = failure("MissingClassModel")
    assert message.startswith("Module zoo.missing_class imports cleanly but has no class 'Model', which "
                              "MissingClassModel is registered as")
    assert detail["kind"] == "missing_class"

    for arch in IMPORT_PASSES:
        assert results[(arch, "import")]["outcome"] == "passed", results[(arch, "import")]


# Their import check fails, and so would their inspection: it is skipped, naming the import. SwallowsCudaModel's
# module catches the CUDA error, so its inspection passes, and a check that passes passes.
IMPORT_FAILS = ["SeedVLForConditionalGeneration", *(a for a in CUDA_AT_IMPORT if a != "SwallowsCudaModel"),
                "MissingDependencyModel", "RaisesModel", "SegfaultModel", "ExitsModel", "HangsModel",
                "MissingClassModel"]


def assert_inspect_results(results: Results) -> None:
    """The registry's inspection, with the child's own words; where the import failed, the inspection says so."""
    for arch in IMPORT_FAILS:
        r = results[(arch, "inspect")]
        assert (r["outcome"], r["message"]) == ("skipped", f"import failed, see enginecheck::{arch}::import"), r
        assert (r["detail"]["kind"], r["detail"]["root"]) == ("dependency", f"enginecheck::{arch}::import")
    not_a_model = results[("NotAModel", "inspect")]
    assert not_a_model["outcome"] == "failed"
    assert not_a_model["message"].startswith(
        "Error inspecting model architecture 'NotAModel' (zoo.not_a_model:Model) in a subprocess. "
        "The child process reported:\nTraceback (most recent call last):\n")
    assert not_a_model["message"].endswith(
        "TypeError: zoo.not_a_model.Model is not a model class: it has no load_weights(); a model must define "
        "forward() and load_weights(weights) -> set[str].\n")
    # the inspection's own failure, kept in the detail of the skip
    assert "ValueError: rope_scaling type 'zigzag'" in results[("RaisesModel", "inspect")]["detail"]["failure"]
    assert results[("HangsModel", "inspect")]["detail"]["failure"].startswith(
        f"Inspecting HangsModel did not finish within {TIMEOUT} s (--enginecheck-timeout)")
    for arch in [*INSPECT_PASSES, "SwallowsCudaModel"]:
        r = results[(arch, "inspect")]
        assert r["outcome"] == "passed", r
        assert (r["detail"]["architecture"], r["detail"]["class_name"]) == (arch, "Model")


SKIPPED_MODULE = "import pytest\n\npytest.importorskip('zoo_module_not_installed')\n"


def test_broken_zoo_serially_and_under_xdist(zoo: pytest.Pytester) -> None:
    zoo.makepyfile(test_project_skipped=SKIPPED_MODULE)  # the project's own tests: one module skips
    args = ("--enginecheck-target=zoo:MODELS", "--enginecheck-checks=import,inspect",
            f"--enginecheck-timeout={TIMEOUT}")
    result, results = run_enginecheck(zoo, *args, "--junitxml=junit.xml", "-rfEs", name="serial")
    # Every item ran: the crash, the exit and the hang in the middle stopped nothing.
    assert set(results) == {(arch, check) for arch in MODELS for check in ("import", "inspect")}
    assert_import_results(results, zoo.path)
    assert_inspect_results(results)
    failed = sum(r["outcome"] == "failed" for r in results.values())
    skipped = len(IMPORT_FAILS)
    result.assert_outcomes(passed=len(results) - failed - skipped, failed=failed, skipped=skipped + 1)
    result.stdout.fnmatch_lines([  # the settings given, then what the target does not offer and why
        f"enginecheck: target=zoo:MODELS ({len(MODELS)} architectures, 0 plugins)",
        f"enginecheck: checks=import,inspect, timeout={TIMEOUT}s"])
    assert ("enginecheck: not offered: plugins (a mapping of architecture -> 'module:Class' has no general plugins); "
            "load, budget, startup, lora, quant (a mapping of architecture -> 'module:Class' has no engine to build it "
            "with; point --enginecheck-target at an engine_ref ModelRegistry)") in unwrapped(result)
    # one line per root cause for the skips
    result.stdout.fnmatch_lines(["SKIPPED [[]1] enginecheck::HangsModel: import failed, see "
                                 "enginecheck::HangsModel::import"])
    # JUnit XML: each check's result as JSON, the same as the JSON report's
    properties = {(case.get("classname"), case.get("name")): json.loads(prop.get("value"))
                  for case in ET.parse(zoo.path / "junit.xml").iter("testcase")
                  for prop in case.iter("property") if prop.get("name") == "enginecheck"}
    assert {(r["arch"], r["check"]): r for r in properties.values()} == results
    result.stdout.fnmatch_lines([
        "*_ enginecheck SeedVLForConditionalGeneration import _*",
        "Importing zoo.seed_vl touched CUDA: it initialized CUDA: torch.cuda.get_device_properties at "
        "*expert_parallel.py:5 (`SM_COUNT = torch.cuda.get_device_properties(0).multi_processor_count*`).",
        "Import chain: zoo.seed_vl -> zoo.seed_lm -> zoo.expert_parallel.",
    ])
    result.stdout.fnmatch_lines([
        "*= enginecheck summary =*",
        "architecture * import  inspect",
        "-----*",
        "DeviceObjectModel * ok      ok*",  # rows sorted by architecture
        "SeedVLForConditionalGeneration  FAIL    skip*",
    ])
    # the table's counts and pytest's agree: the project's skipped module is counted beside them (no -m: it would run)
    assert (f"{len(MODELS)} architectures: {len(results) - failed - skipped} passed, {failed} failed, {skipped} "
            f"skipped ({skipped} because a check they depend on failed); other tests: 1 skipped") in unwrapped(result)
    result.stdout.fnmatch_lines(["FAILED enginecheck::SegfaultModel::import - Importing zoo.segfault crashed*"])
    # A CUDA failure reads as its sentences alone, no traceback.
    assert section(result.stdout.str(), "enginecheck SeedVLForConditionalGeneration import") == \
        results[("SeedVLForConditionalGeneration", "import")]["message"]

    xresult, xresults = run_enginecheck(zoo, *args, "-n", "2", "--enginecheck-summary=failures", name="xdist")
    xresult.stdout.fnmatch_lines(["*2 workers*", "*= enginecheck summary =*", "architecture * import  inspect",
                                  "-----*", "ExitsModel * FAIL    skip*"])
    # only the rows with a failure, and the count of the others
    assert "DeviceObjectModel" not in xresult.stdout.str()
    assert (f"({len(INSPECT_PASSES)} architectures without a failure not shown; --enginecheck-summary=all lists "
            f"them)") in unwrapped(xresult)
    # the same verdicts, and the same dependencies, whichever worker ran the root
    assert {(r["arch"], r["check"], r["outcome"], r["message"] if r["outcome"] == "skipped" else "")
            for r in xresults.values()} == \
           {(r["arch"], r["check"], r["outcome"], r["message"] if r["outcome"] == "skipped" else "")
            for r in results.values()}
    assert xresults[("SeedVLForConditionalGeneration", "import")]["detail"]["chain"] == \
           ["zoo.seed_vl", "zoo.seed_lm", "zoo.expert_parallel"]


def test_strict_mode_fails_cuda_queries_at_import(zoo: pytest.Pytester) -> None:
    result, results = run_enginecheck(zoo, "--enginecheck-target=zoo:MODELS", "--enginecheck-checks=import",
                                      "--enginecheck-strict", "-k", "Queries or Guarded or DeviceObject or Cached")
    assert {arch: r["outcome"] for (arch, _), r in results.items()} == {
        "QueriesAvailableModel": "failed", "QueriesDeviceCountModel": "failed",
        "GuardedModel": "failed",  # `if torch.cuda.is_available():` at import is itself a query
        "DeviceObjectModel": "passed", "CachedCapabilityModel": "passed",
    }
    for arch, module, api, code in [
        ("QueriesAvailableModel", "queries_available", "torch.cuda.is_available",
         "HAS_GPU = torch.cuda.is_available()"),
        ("QueriesDeviceCountModel", "queries_device_count", "torch.cuda.device_count",
         "NUM_GPUS = torch.cuda.device_count()"),
    ]:
        r = results[(arch, "import")]
        path = zoo.path / "zoo" / f"{module}.py"
        assert (r["detail"]["api"], r["detail"]["access"], r["detail"]["line"]) == (api, "query", line_of(path, api))
        assert r["message"].startswith(f"Importing zoo.{module} queried CUDA: it called {api}() at {path}:"
                                       f"{r['detail']['line']} (`{code}`), which runs cuInit on a GPU host")
        assert "PYTORCH_NVML_BASED_CUDA_CHECK=1" in r["message"]
    result.assert_outcomes(passed=2, failed=3, deselected=len(MODELS) - 5)


@pytest.fixture(scope="module")
def tp_diagnosis(tmp_path_factory: pytest.TempPathFactory) -> ZooSession:
    """The load and startup run over zoo.tp_registry (BadShardLlamaForCausalLM among its TP bugs), shared with
    test_diagnosis."""
    return zoo_session(tmp_path_factory, "tp-diagnosis", *TP_DIAGNOSIS)


def test_load_catches_wrong_sharding_and_startup_catches_leaks(zoo: pytest.Pytester, tp_diagnosis: ZooSession) -> None:
    """BadShardLlamaForCausalLM's load items are read from the shared tp-diagnosis session (the same class,
    zoo.engine_models:BadShardLlamaForCausalLM, the same load check); the leaks run here."""
    shard = tp_diagnosis.results
    assert {check: shard[("BadShardLlamaForCausalLM", check)]["outcome"] for check in ("load[tp=1]", "load[tp=2]")} \
        == {"load[tp=1]": "passed", "load[tp=2]": "failed"}
    tp_diagnosis.result.stdout.fnmatch_lines([glob("architecture * load[tp=1]  load[tp=2]  startup"),
                                              "BadShardLlamaForCausalLM * ok * FAIL *"])
    result, results = run_enginecheck(zoo, "--enginecheck-target=zoo.registry:REGISTRY",
                                      "--enginecheck-checks=load,startup", "-k", "Leak and startup")
    assert {key: r["outcome"] for key, r in results.items()} == {
        ("TempLeakLlamaForCausalLM", "startup"): "failed",
        ("ProcessLeakLlamaForCausalLM", "startup"): "failed",
    }
    tp1 = shard[("BadShardLlamaForCausalLM", "load[tp=1]")]["detail"]
    assert tp1["tensor_parallel_size"] == 1 and len(tp1["bytes_read_per_rank"]) == 1
    tp2 = shard[("BadShardLlamaForCausalLM", "load[tp=2]")]
    assert tp2["message"].startswith("At tensor_parallel_size=2, BadShardLlamaForCausalLM generates different "
                                     "tokens than at tensor_parallel_size=1 (prompt ")
    assert tp2["message"].endswith("The first module whose output differs between tensor_parallel_size=1 and 2 is "
                                   "model.layers.0.mlp.down_proj (MirroredRowParallelLinear): its weights do not "
                                   "reassemble to the TP=1 weights (rank 0's weight holds input columns 64:128 of the "
                                   "TP=1 weight, not its own 0:64): a sharding bug in its weight_loader: its "
                                   "parameters were loaded by "
                                   f"{zoo_loader('MirroredRowParallelLinear.weight_loader')}."), tp2
    assert tp2["detail"]["kind"] == "tp_mismatch" and tp2["detail"]["outputs"] != tp2["detail"]["reference"]

    temp = results[("TempLeakLlamaForCausalLM", "startup")]
    # the entries as leaks.py lists them: inside the engine's own temp dir (engine_ref-<pid>-<start>-XXXXXXXX)
    assert re.match(r"TempLeakLlamaForCausalLM started and shut down at tensor_parallel_size=2, but left behind: "
                    r"temp entries \['(engine_ref-[^/']+/)?zoo-kernel-cache-", temp["message"]), temp["message"]
    assert temp["detail"]["kind"] == "leak"
    procs = results[("ProcessLeakLlamaForCausalLM", "startup")]
    assert procs["message"].startswith("ProcessLeakLlamaForCausalLM started and shut down at tensor_parallel_size=2, "
                                       "but left behind: child processes [")
    # one helper per rank, and none of them outlived the check
    helpers = re.fullmatch(r".*child processes \[(\d+), (\d+)\] \(\1: .*time\.sleep\(60\)'; \2: .*\)\.",
                           procs["message"])  # each with its command line
    assert helpers, procs["message"]
    assert [pid for pid in map(int, helpers.groups()) if alive(pid, "time.sleep(60)")] == []
    result.stdout.fnmatch_lines([glob(line) for line in (
        "*= enginecheck summary =*",
        "architecture * startup",
        "-----*",
        "ProcessLeakLlamaForCausalLM * FAIL*",
        "TempLeakLlamaForCausalLM * FAIL*",
        "2 architectures: 0 passed, 2 failed, 0 skipped",
    )])
    # the table of both runs' items together, as one run of both printed it: '-' where a check did not run
    both = [shard[("BadShardLlamaForCausalLM", check)] for check in ("load[tp=1]", "load[tp=2]")]
    both += results.values()
    pytest.RunResult(0, summary_table(both), [], 0.0).stdout.fnmatch_lines([glob(line) for line in (
        "architecture * load[tp=1]  load[tp=2]  startup",
        "-----*",
        "BadShardLlamaForCausalLM * ok * FAIL * -*",
        "ProcessLeakLlamaForCausalLM * - * - * FAIL*",
        "TempLeakLlamaForCausalLM * - * - * FAIL*",
        "3 architectures: 1 passed, 3 failed, 0 skipped",
    )])


def test_tp_checks_skip_when_no_tp_size_splits_the_model(pytester: pytest.Pytester) -> None:
    """Only TP sizes the model cannot split: load and startup skip, saying why, instead of failing."""
    result, results = run_enginecheck(pytester, "--enginecheck-checks=load,startup", "--enginecheck-tp=3,5",
                                      "-k", "LlamaForCausalLM")
    result.assert_outcomes(skipped=3, deselected=(len(BUNDLED) - 1) * 3)
    assert {key: r["outcome"] for key, r in results.items()} == {
        ("LlamaForCausalLM", check): "skipped" for check in ("load[tp=3]", "load[tp=5]", "startup")}
    startup = results[("LlamaForCausalLM", "startup")]["message"]
    assert startup.startswith("no tensor_parallel_size of --enginecheck-tp=3,5 splits LlamaForCausalLM: "
                              "tensor_parallel_size=5 does not divide num_attention_heads=4"), startup
    assert "tensor_parallel_size=3 does not divide num_attention_heads=4" in startup
    assert results[("LlamaForCausalLM", "load[tp=3]")]["message"].startswith("tensor_parallel_size=3 does not divide")
    result.stdout.fnmatch_lines(["*= enginecheck summary =*", "1 architecture: 0 passed, 0 failed, 3 skipped"])


NORMAL_TEST = "def test_project_unit():\n    assert True\n"


def test_bundled_zoo_main_job(pytester: pytest.Pytester) -> None:
    """README's main job: every architecture of engine_ref passes; the project's own test is deselected."""
    pytester.makepyfile(test_project=NORMAL_TEST)
    result, results = run_enginecheck(pytester, "-m", "enginecheck", "-v", CHECKS)
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=len(BUNDLED) * len(BUNDLED_CHECKS), deselected=1)
    assert sorted(results) == sorted((arch, check) for arch in BUNDLED for check in BUNDLED_CHECKS)
    assert [r["message"] for r in results.values() if r["outcome"] != "passed"] == []
    for tp in (1, 2):
        detail = results[("LlamaForCausalLM", f"load[tp={tp}]")]["detail"]
        assert detail["tensor_parallel_size"] == tp and len(detail["bytes_read_per_rank"]) == tp
    assert results[("LlavaForConditionalGeneration", "inspect")]["detail"]["supports_multimodal"] is True
    assert "test_project_unit" not in result.stdout.str()
    result.stdout.fnmatch_lines([glob(f"enginecheck::{arch}::{check} PASSED*") for arch in BUNDLED
                                 for check in BUNDLED_CHECKS])
    result.stdout.fnmatch_lines([glob(line) for line in (
        "*= enginecheck summary =*",
        "architecture                   import  inspect  load[tp=1]  load[tp=2]  startup",
        "-------------------------------------------------------------------------------",
        "LlamaForCausalLM               ok      ok       ok          ok          ok*",
        "LlavaForConditionalGeneration  ok      ok       ok          ok          ok*",
        "MixtralForCausalLM             ok      ok       ok          ok          ok*",
        "Qwen2ForCausalLM               ok      ok       ok          ok          ok*",
        "Qwen3MoeForCausalLM            ok      ok       ok          ok          ok*",
        f"5 architectures: {len(results)} passed, 0 failed, 0 skipped",
    )])


def test_bundled_zoo_node_ids_and_selection(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_project=NORMAL_TEST)
    listed = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", CHECKS, "--collect-only", "-q",
                                           timeout=300)
    assert listed.ret == 0, listed.stdout.str() + listed.stderr.str()
    node_ids = [line for line in listed.outlines if "::" in line]
    assert node_ids == ["test_project.py::test_project_unit"] + [
        f"enginecheck::{arch}::{check}" for arch in BUNDLED for check in BUNDLED_CHECKS]
    assert "enginecheck::LlamaForCausalLM::load[tp=2]" in node_ids

    result, results = run_enginecheck(pytester, CHECKS, "-k", "Llama and import")
    result.assert_outcomes(passed=1, deselected=len(node_ids) - 1)
    assert list(results) == [("LlamaForCausalLM", "import")]


ROOT_CAUSE_CHECKS = "--enginecheck-checks=import,inspect,load,budget,startup"
CUDA_ARCH, BUILD_ARCH = "CudaAtImportLlamaForCausalLM", "BrokenBuildLlamaForCausalLM"
AFTER_IMPORT = ["inspect", "load[tp=1]", "load[tp=2]", "budget[tp=1]", "budget[tp=2]", "startup"]
AFTER_BUILD = ["load[tp=2]", "budget[tp=1]", "budget[tp=2]", "startup"]


@pytest.fixture(scope="module")
def root_causes(tmp_path_factory: pytest.TempPathFactory) -> ZooSession:
    """The serial run over zoo.root_causes, shared with test_sharding and test_html_report."""
    return zoo_session(tmp_path_factory, "root-causes", *ROOT_CAUSES)


def test_one_root_cause_one_failure_serially_and_under_xdist(zoo: pytest.Pytester, root_causes: ZooSession) -> None:
    """A module that touches CUDA at import fails its import check alone; a model that cannot be built fails
    load[tp=1] alone; every check that depends on them says so, whichever worker ran the root. The serial run is
    the shared one (the same target, checks and ``-rfEs``); the xdist run is this test's own."""
    args = ("--enginecheck-target=zoo.root_causes:REGISTRY", ROOT_CAUSE_CHECKS, "-rfEs")
    assert set(args) <= set(ROOT_CAUSES)
    verdicts: dict[str, set[tuple[str, str, str, str]]] = {}
    for mode in ("serial", "xdist"):
        if mode == "serial":
            result, results = root_causes.result, validated(root_causes.report, "zoo.root_causes:REGISTRY")
        else:
            result, results = run_enginecheck(zoo, *args, "-n", "2", name=mode)
        result.assert_outcomes(passed=2, failed=2, skipped=len(AFTER_IMPORT) + len(AFTER_BUILD))
        # under xdist every item waited for its turn (rank_turns: multi-rank items run alone), serially none did
        assert {"turn.wait" in r["phases"] for r in results.values()} == {mode == "xdist"}
        assert {key for key, r in results.items() if r["outcome"] == "failed"} == \
               {(CUDA_ARCH, "import"), (BUILD_ARCH, "load[tp=1]")}
        for arch, root, dependents in ((CUDA_ARCH, "import", AFTER_IMPORT), (BUILD_ARCH, "load[tp=1]", AFTER_BUILD)):
            for check in dependents:
                r = results[(arch, check)]
                assert (r["outcome"], r["message"]) == ("skipped", f"{root} failed, see enginecheck::{arch}::{root}")
            result.stdout.fnmatch_lines([glob(f"SKIPPED [{len(dependents)}] enginecheck::{arch}: {root} failed, "
                                              f"see enginecheck::{arch}::{root}")])
        # the root failures read as they did before
        assert results[(CUDA_ARCH, "import")]["message"].startswith(
            "Importing zoo.cuda_llama touched CUDA: it initialized CUDA: torch.zeros at ")
        assert results[(BUILD_ARCH, "load[tp=1]")]["message"] == (
            f"Loading {BUILD_ARCH} at tensor_parallel_size=1 raised ValueError: rope_theta must be set for the "
            f"broken-build zoo model")
        assert sorted(line.split(" - ")[0] for line in result.outlines if line.startswith("FAILED ")) == [
            f"FAILED enginecheck::{BUILD_ARCH}::load[tp=1]", f"FAILED enginecheck::{CUDA_ARCH}::import"]
        result.stdout.fnmatch_lines(["*= enginecheck summary =*"])
        assert "2 architectures: 2 passed, 2 failed, 10 skipped (10 because a check they depend on failed)" in \
            unwrapped(result)
        verdicts[mode] = {(*key, r["outcome"], r["message"] if r["outcome"] == "skipped" else "")
                          for key, r in results.items()}
    assert verdicts["xdist"] == verdicts["serial"]


def test_a_deselected_root_blames_nothing(zoo: pytest.Pytester) -> None:
    """Without its root in the run, a dependent check fails with its own failure: nothing passes silently."""
    result, results = run_enginecheck(zoo, "--enginecheck-target=zoo.root_causes:REGISTRY",
                                      "--enginecheck-checks=import,inspect", "-k", CUDA_ARCH,
                                      "--deselect", f"enginecheck::{CUDA_ARCH}::import")
    result.assert_outcomes(failed=1, deselected=3)
    assert results[(CUDA_ARCH, "inspect")]["message"].startswith(f"Error inspecting model architecture '{CUDA_ARCH}'")


def test_budget_check_options(pytester: pytest.Pytester) -> None:
    """The budget check's device size, utilisation and max_model_len come from options (ini or flag), are printed
    in the header, and a tiny checkpoint too big for them says to shrink example_config."""
    args = ("--enginecheck-checks=budget", "--enginecheck-tp=1", "-k", "LlamaForCausalLM")
    result, results = run_enginecheck(pytester, *args, "--enginecheck-budget-utilization=0.5",
                                      "--enginecheck-budget-max-model-len=64", name="fits")
    result.assert_outcomes(passed=1, deselected=len(BUNDLED) - 1)
    result.stdout.fnmatch_lines(["enginecheck: target=engine_ref (5 architectures, 0 plugins), tp=1",
                                 "enginecheck: checks=budget",  # a budget of its own: in full (not only with -v)
                                 "enginecheck: budget=512MiB per rank x 0.5 utilization at max_model_len=64"])
    fits = results[("LlamaForCausalLM", "budget[tp=1]")]
    assert {k: fits["detail"][k] for k in ("budget", "gpu_memory_utilization", "max_model_len")} == \
           {"budget": "512MiB", "gpu_memory_utilization": 0.5, "max_model_len": 64}
    assert {"engine.config", "engine.executor", "engine.kv_cache"} <= set(fits["phases"])  # the engine's phases

    pytester.makeini("[pytest]\nenginecheck_budget_memory = 2MiB\n")
    result, results = run_enginecheck(pytester, *args, name="too_small")
    result.assert_outcomes(failed=1, deselected=len(BUNDLED) - 1)
    result.stdout.fnmatch_lines(["enginecheck: checks=budget, budget=2MiB per rank"])
    message = results[("LlamaForCausalLM", "budget[tp=1]")]["message"]
    assert re.fullmatch(
        r"The tiny checkpoint of LlamaForCausalLM \(made from its example_config\) does not fit the budget check's "
        r"device at tensor_parallel_size=1: rank 0 needs [\d.]+ [KM]iB \(.*\) but the budget is 2\.00 MiB\. Shrink "
        r"example_config \(fewer layers, a smaller hidden_size, intermediate_size or vocab_size\) so the tiny model "
        r"fits 2MiB per rank at gpu_memory_utilization=0\.9 and max_model_len=128 \(--enginecheck-budget-memory, "
        r"--enginecheck-budget-utilization, --enginecheck-budget-max-model-len\)\.", message), message


def test_summary_at_scale_lists_failures_first_and_counts_the_rest() -> None:
    results = [{"arch": f"Arch{i:03d}ForCausalLM", "check": check, "outcome": "passed", "detail": {}}
               for i in range(450) for check in ("import", "inspect")]
    results[301] = {**results[301], "outcome": "failed"}  # Arch150's inspect
    results[10] = {**results[10], "outcome": "failed"}  # Arch005's import
    results[11] = {**results[11], "outcome": "skipped", "detail": {"kind": "dependency"}}
    assert summary_table(results, summary_mode(None, 450)) == [  # from 400 architectures: failures alone, by default
        "architecture        import  inspect",
        "-----------------------------------",
        "Arch005ForCausalLM  FAIL    skip   ",
        "Arch150ForCausalLM  ok      FAIL   ",
        "(448 architectures without a failure not shown; --enginecheck-summary=all lists them)",
        "450 architectures: 897 passed, 2 failed, 1 skipped (1 because a check they depend on failed)",
    ]
    every = summary_table(results, "all", {"passed": 3, "failed": 0})
    assert every[2:5] == ["Arch005ForCausalLM  FAIL    skip   ", "Arch150ForCausalLM  ok      FAIL   ",
                          "Arch000ForCausalLM  ok      ok     "]  # failures first
    assert len(every) == 2 + 450 + 1 and every[-1].endswith("; other tests: 3 passed")
