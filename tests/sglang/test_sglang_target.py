"""``pytest --enginecheck --enginecheck-target=sglang`` end to end (pytester, a pytest subprocess per run) over the
real out-of-tree model packages of model_dist and SGLang's own model package: each case's verdict on its own item.

The whole registry (580 items) is the README's measurement, not a test: these runs select with ``-k``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.sglang.model_dist import BROKEN_DIST, BROKEN_PACKAGE, DIST, PACKAGE, RAISING_MESSAGE

RUN_TIMEOUT_S = 600
# The derived preload is cached per SGLang install under the user's cache (pytester moves HOME into its temp dir).
USER_CACHE = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")


@pytest.fixture
def sglang_run(pytester: pytest.Pytester, model_site: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``sglang_run(package, *args)``: the run's RunResult and its JSON results by item (arch, check), with
    ``SGLANG_EXTERNAL_MODEL_PACKAGE=package`` (unset for None)."""
    monkeypatch.setenv("PYTHONPATH", str(model_site))
    monkeypatch.setenv("XDG_CACHE_HOME", USER_CACHE)

    def run(package: str | None, *args: str) -> tuple[pytest.RunResult, dict[tuple[str, str], dict[str, Any]]]:
        if package is None:
            monkeypatch.delenv("SGLANG_EXTERNAL_MODEL_PACKAGE", raising=False)
        else:
            monkeypatch.setenv("SGLANG_EXTERNAL_MODEL_PACKAGE", package)
        report = pytester.path / f"report-{len(list(pytester.path.glob('report-*')))}.json"
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck",
                                               "--enginecheck-target=sglang", f"--enginecheck-json={report}", "-rfs",
                                               *args, timeout=RUN_TIMEOUT_S)
        results = json.loads(report.read_text())["results"] if report.exists() else []
        return result, {(r["arch"], r["check"]): r for r in results}

    return run


def test_out_of_tree_package_verdicts(sglang_run: Any) -> None:
    result, by_item = sglang_run(PACKAGE, "-m", "enginecheck", "-k", "Ecsg or plugin")
    outcomes = {item: r["outcome"] for item, r in by_item.items()}
    assert outcomes == {
        (f"plugin:{PACKAGE}", "plugins"): "failed",
        ("EcsgCleanForCausalLM", "import"): "passed", ("EcsgCleanForCausalLM", "inspect"): "passed",
        ("EcsgCudaForCausalLM", "import"): "failed", ("EcsgCudaForCausalLM", "inspect"): "skipped",
        ("EcsgRaisingForCausalLM", "import"): "failed", ("EcsgRaisingForCausalLM", "inspect"): "skipped",
        ("EcsgUnservableForCausalLM", "import"): "passed", ("EcsgUnservableForCausalLM", "inspect"): "failed",
    }, result.stdout.str()
    assert result.ret == 1
    result.stdout.fnmatch_lines(["enginecheck: target=sglang (* architectures, 1 plugin)",
                                 "enginecheck: checks=plugins,import,inspect"])
    assert "enginecheck: not offered: load, budget, startup (SGLang has no CPU build " in " ".join(
        line.strip() for line in result.outlines)  # the header's lines wrapped to the terminal, joined back
    cuda = by_item["EcsgCudaForCausalLM", "import"]["message"]
    assert cuda.startswith(f"Importing {PACKAGE}.cuda_model touched CUDA: it initialized CUDA: torch.cuda.init at ")
    assert f"{PACKAGE}/_impl/kernels.py:3" in cuda
    assert (f"Import chain: {PACKAGE}.cuda_model -> {PACKAGE}._impl.layer -> {PACKAGE}._impl.kernels."
            in cuda), cuda
    raising = by_item["EcsgRaisingForCausalLM", "import"]["message"]
    assert raising.startswith(f"Importing {PACKAGE}.raising raised RuntimeError: {RAISING_MESSAGE}\n"
                              f"SGLang's registry (registry.import_model_classes) drops a module"), raising
    assert f"'Ignore import error when loading {PACKAGE}.raising'" in raising
    assert by_item["EcsgRaisingForCausalLM", "inspect"]["message"] == (
        "import failed, see enginecheck::EcsgRaisingForCausalLM::import")
    assert by_item["EcsgUnservableForCausalLM", "inspect"]["message"] == (
        "SGLang cannot serve EcsgUnservableForCausalLM: it has no load_weights: SGLang's loader calls "
        "model.load_weights(weights)")
    assert by_item["EcsgCleanForCausalLM", "inspect"]["detail"]["classes"] == {
        "EcsgCleanForCausalLM": {"pipeline_parallel": True, "input_embeds": True, "get_embedding": True}}
    profile = by_item["EcsgCleanForCausalLM", "import"]["detail"]["import_profile"]  # issue 21: all targets
    assert profile and {"module", "self_s", "cumulative_s", "chain"} <= set(profile[0]), profile
    # The package, loaded as SGLang loads it in a fresh interpreter: its registry silently drops the raising module
    # (and, without a GPU, the CUDA one: torch.cuda.init() raises there).
    plugin = by_item[f"plugin:{PACKAGE}", "plugins"]["message"]
    assert plugin.startswith(f"Loading SGLang plugin '{PACKAGE}' ({PACKAGE}) of distribution {DIST} works here but "
                             f"fails in SGLang's own registry in a fresh interpreter "
                             f"(SGLANG_EXTERNAL_MODEL_PACKAGE={PACKAGE}, "), plugin
    assert "SGLang's registry silently dropped " in plugin and "EcsgRaisingForCausalLM" in plugin
    assert "EcsgCleanForCausalLM" not in plugin.split("dropped", 1)[1]
    assert f"Ignore import error when loading {PACKAGE}.raising: {RAISING_MESSAGE}" in plugin


def test_in_tree_mamba_modules_fail_their_import_for_causal_conv1d_fn(sglang_run: Any) -> None:
    """SGLang 0.5.23's own registry drops mamba and falcon_mamba with a warning; the target reports both."""
    result, by_item = sglang_run(None, "-m", "enginecheck", "--enginecheck-checks=import", "-k",
                                 "MambaForCausalLM or Mamba2ForCausalLM")
    outcomes = {item: r["outcome"] for item, r in by_item.items()}
    assert outcomes == {("FalconMambaForCausalLM", "import"): "failed", ("MambaForCausalLM", "import"): "failed",
                        ("Mamba2ForCausalLM", "import"): "passed"}, result.stdout.str()
    for arch, module in (("FalconMambaForCausalLM", "falcon_mamba"), ("MambaForCausalLM", "mamba")):
        result_ = by_item[arch, "import"]
        assert result_["message"].startswith(
            f"Importing sglang.srt.models.{module} raised ImportError: cannot import name 'causal_conv1d_fn' from "
            f"'sglang.srt.layers.attention.mamba.mamba'"), result_["message"]
        assert result_["detail"]["kind"] == "exception"
    assert "target=sglang (0 plugins" not in result.stdout.str()  # the settings line counts architectures
    result.stdout.fnmatch_lines(["enginecheck: target=sglang (* architectures, 0 plugins)",
                                 "enginecheck: checks=import"])


def test_a_package_whose_init_raises_is_a_collection_error(sglang_run: Any) -> None:
    """SGLang's registry itself fails to import then: every architecture of the package goes with it."""
    result, by_item = sglang_run(BROKEN_PACKAGE, "-m", "enginecheck", "--enginecheck-checks=plugins",
                                 "--continue-on-collection-errors")
    assert by_item == {}, by_item
    result.stdout.fnmatch_lines([
        f"Loading SGLang plugin '{BROKEN_PACKAGE}' ({BROKEN_PACKAGE}) of distribution {BROKEN_DIST} raised "
        f"ImportError: ecsg_broken: its __init__ cannot find its configuration at *{BROKEN_PACKAGE}/__init__.py:1",
        "It failed while the target was described; not checked: EcsgBrokenForCausalLM (registered by it before it "
        "raised).",
        "*1 error in *"])
    assert result.ret == 1
