"""``pytest --enginecheck --enginecheck-target=vllm`` end to end (pytester, a pytest subprocess per run) over
the real out-of-tree plugin distribution of plugin_dist: each case's verdict on its own item, and the run's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.plugin_dist import CUDA_PKG_DIST, DIST

RUN_TIMEOUT_S = 900


@pytest.fixture
def vllm_run(pytester: pytest.Pytester, plugin_site: Path, tmp_path_factory: pytest.TempPathFactory,
             monkeypatch: pytest.MonkeyPatch) -> Any:
    """``vllm_run(plugins, *args)``: the run's RunResult and its JSON results by item (arch, check)."""
    monkeypatch.setenv("PYTHONPATH", str(plugin_site))
    # One derived preload for the session's runs (its key includes the installed plugins).
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))

    def run(plugins: str, *args: str) -> tuple[pytest.RunResult, dict[tuple[str, str], dict[str, Any]]]:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)
        report = pytester.path / f"report-{len(list(pytester.path.glob('report-*')))}.json"
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", "--enginecheck-target=vllm",
                                               f"--enginecheck-json={report}", "-rfs", *args, timeout=RUN_TIMEOUT_S)
        results = json.loads(report.read_text())["results"] if report.exists() else []
        return result, {(r["arch"], r["check"]): r for r in results}

    return run


def test_plugins_import_and_inspect_verdicts(vllm_run: Any) -> None:
    result, by_item = vllm_run("clean,cuda_chain,class_registered,raising,cudapkg", "--enginecheck-strict",
                               "--enginecheck-checks=plugins,import,inspect", "-k", "Ectp or plugin",
                               "--continue-on-collection-errors")
    outcomes = {item: r["outcome"] for item, r in by_item.items()}
    assert outcomes == {
        ("plugin:clean", "plugins"): "passed", ("plugin:cuda_chain", "plugins"): "passed",
        ("plugin:class_registered", "plugins"): "passed", ("plugin:cudapkg", "plugins"): "failed",
        ("EctpCleanForCausalLM", "import"): "passed", ("EctpCleanForCausalLM", "inspect"): "passed",
        ("EctpClassForCausalLM", "import"): "passed", ("EctpClassForCausalLM", "inspect"): "passed",
        ("EctpCudaForCausalLM", "import"): "failed", ("EctpCudaForCausalLM", "inspect"): "skipped",
    }, result.stdout.str()
    assert result.ret == 1
    # A plugin that raises while the target is described is a collection error under its name, not an item.
    result.stdout.fnmatch_lines([
        f"Loading vLLM plugin 'raising' (ectp.entry:register_raising) of distribution {DIST} raised RuntimeError: "
        "ectp: the raising plugin cannot find its configuration at *",
        "It failed while the target was described; it registered no architecture before it raised*",
        "*, 1 error in *"])  # -rfs leaves errors out of the short summary
    cudapkg = by_item["plugin:cudapkg", "plugins"]["message"]
    assert "queried CUDA" in cudapkg and "ectp_cudapkg/__init__.py:3" in cudapkg and CUDA_PKG_DIST in cudapkg
    cuda = by_item["EctpCudaForCausalLM", "import"]["message"]
    assert cuda.startswith("Importing ectp.models.cuda_model touched CUDA")
    assert "Import chain: ectp.models.cuda_model -> ectp.models.cuda_helper." in cuda
    assert by_item["EctpCudaForCausalLM", "inspect"]["message"] == (
        "import failed, see enginecheck::EctpCudaForCausalLM::import")
    assert by_item["EctpClassForCausalLM", "inspect"]["detail"]["architecture"] == "EctpClassForCausalLM"
    header = [line for line in result.outlines if line.startswith("enginecheck: ")]  # target, then checks
    assert header[0].startswith("enginecheck: target=vllm (") and header[1] == (
        "enginecheck: checks=plugins,import,inspect, strict=on"), header
    # vLLM's log lines stay in the checks' captured output: none reaches the terminal of a run without failures
    # shown in full (-rfs shows only the short summary).
    assert not [line for line in result.outlines if " [registry.py:" in line or line.startswith("INFO ")]


def test_engine_checks_name_the_wrong_shard_and_what_the_budget_needs(vllm_run: Any) -> None:
    result, by_item = vllm_run("clean,bad_shard,hungry", "--enginecheck-checks=load,budget",
                               "--enginecheck-budget-memory=16MiB", "-k", "EctpClean or EctpBadShard or EctpHungry")
    outcomes = {item: r["outcome"] for item, r in by_item.items()}
    assert outcomes[("EctpCleanForCausalLM", "load[tp=2]")] == "passed", result.stdout.str()
    assert outcomes[("EctpCleanForCausalLM", "budget[tp=1]")] == "passed"
    assert outcomes[("EctpBadShardForCausalLM", "load[tp=1]")] == "passed"
    assert outcomes[("EctpBadShardForCausalLM", "load[tp=2]")] == "failed"
    assert outcomes[("EctpHungryForCausalLM", "budget[tp=1]")] == "failed"
    assert result.ret == 1
    shard = by_item["EctpBadShardForCausalLM", "load[tp=2]"]["message"]
    assert shard.startswith("EctpBadShardForCausalLM at tensor_parallel_size=2 generates other greedy tokens")
    hungry = by_item["EctpHungryForCausalLM", "budget[tp=1]"]["message"]
    assert hungry.startswith("EctpHungryForCausalLM at tensor_parallel_size=1 (float32): rank 0 needs 3"), hungry
    assert "buffers 32.0" in hungry and "but the budget is 16MiB" in hungry  # its 32 MiB table and the rotary cache


def test_both_inspect_modes_give_the_same_model_info(vllm_run: Any) -> None:
    sample = ("MixtralForCausalLM", "EctpCleanForCausalLM", "EctpClassForCausalLM")
    infos = {}
    for mode in ("fork", "subprocess"):
        result, by_item = vllm_run("clean,class_registered", "--enginecheck-checks=inspect",
                                   f"--enginecheck-inspect={mode}", "-k", " or ".join(sample))
        assert all(by_item[arch, "inspect"]["outcome"] == "passed" for arch in sample), result.stdout.str()
        # the ModelInfo, not the run's own measurements of it (cache lookups, payload sizes)
        infos[mode] = {arch: {k: v for k, v in by_item[arch, "inspect"]["detail"].items()
                              if k not in ("cache", "payload_bytes")} for arch in sample}
    assert infos["fork"] == infos["subprocess"]
    assert infos["fork"]["MixtralForCausalLM"]["architecture"] == "MixtralForCausalLM"
