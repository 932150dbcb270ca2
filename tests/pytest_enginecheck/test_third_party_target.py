"""A target shipped by a third party: a distribution with an entry point in ``pytest_enginecheck.targets``, found
and run without a line of this project naming it. Its engine is a package of two model modules: one clean, one
whose import initialises CUDA two imports down. The core's import check judges both."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TARGET_MODULE = '''
from pytest_enginecheck.targets import ArchEntry, Offer, PluginGroup, Target, TargetDescription

REASON = "the toy engine has no engine to build: only its imports are checked"


class ToyTarget(Target):
    name = "toy"
    label = "Toy"

    def offered(self):
        from pytest_enginecheck.checks import CHECKS

        return Offer(("import",), tuple((c, REASON) for c in CHECKS if c != "import"))

    def describe(self, strict=False):
        entries = (ArchEntry("GoodForCausalLM", "toyengine.models.good", "GoodForCausalLM"),
                   ArchEntry("CudaForCausalLM", "toyengine.models.cuda", "CudaForCausalLM"))
        return TargetDescription(self.spec, self.name, entries, self.offered())

    def check_function(self, check):
        from pytest_enginecheck.checks.import_check import run

        return run


def target(spec):
    return ToyTarget(spec)


class ToyQuantTarget(ToyTarget):
    """Offers quant, but not its fp8 method: no item of it is made, the header names it once."""

    name = "toyquant"

    def offered(self):
        return Offer(("import", "quant"), (("quant[fp8]", "the toy engine has no fp8 kernel: use int8"),))

    def check_function(self, check):
        return lambda ctx: {"quantization": ctx.quantization}


def quant_target(spec):
    return ToyQuantTarget(spec)
'''


def write_site(site: Path) -> Path:
    models = site / "toyengine" / "models"
    models.mkdir(parents=True)
    (site / "toyengine" / "__init__.py").write_text("")
    (models / "__init__.py").write_text("")
    (models / "good.py").write_text("class GoodForCausalLM:\n    pass\n")
    (models / "cuda.py").write_text("from toyengine import kernels  # noqa: F401\n\nclass CudaForCausalLM:\n    pass\n")
    (site / "toyengine" / "kernels.py").write_text("import torch\n\ntorch.cuda.init()\n")
    (site / "toyengine_target.py").write_text(textwrap.dedent(TARGET_MODULE))
    info = site / "toyengine_target-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyengine-target\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pytest_enginecheck.targets]\ntoy = toyengine_target:target\n"
                                           "toyquant = toyengine_target:quant_target\n")
    # another engine's general plugin, installed: a run of another target that selects nothing says so
    plugin = site / "othervllmplugin-0.1.dist-info"
    plugin.mkdir()
    (plugin / "METADATA").write_text("Metadata-Version: 2.1\nName: othervllmplugin\nVersion: 0.1\n")
    (plugin / "entry_points.txt").write_text("[vllm.general_plugins]\nmyplugin = othervllmplugin:register\n")
    return site


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_site(tmp_path_factory.mktemp("site"))


def pytest_run(tmp_path: Path, site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "300",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--enginecheck", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_a_third_party_target_is_found_by_its_entry_point_and_checked(site: Path, tmp_path: Path) -> None:
    out = pytest_run(tmp_path, site, "--enginecheck-target=toy", "-rA")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "enginecheck: target=toy (2 architectures, 0 plugins)\nenginecheck: checks=import\n" in text
    assert "not offered: plugins, inspect, load, budget, startup, lora, quant (the toy engine has no engine" in text
    assert "PASSED enginecheck::GoodForCausalLM::import" in text
    assert "FAILED enginecheck::CudaForCausalLM::import - Importing toyengine.models.cuda touched CUDA" in text
    assert "toyengine.models.cuda -> toyengine.kernels" in text  # the import chain


def test_a_check_the_target_does_not_offer_is_a_usage_error_with_its_reason(site: Path, tmp_path: Path) -> None:
    out = pytest_run(tmp_path, site, "--enginecheck-target=toy", "--enginecheck-checks=import,load")
    assert out.returncode == int(pytest.ExitCode.USAGE_ERROR), out.stdout + out.stderr
    assert ("--enginecheck-checks: load cannot run on a toy target (only import): load: the toy engine has no "
            "engine to build") in out.stderr


def test_an_unknown_target_lists_the_installed_ones(site: Path, tmp_path: Path) -> None:
    out = pytest_run(tmp_path, site, "--enginecheck-target=nope")
    assert out.returncode == int(pytest.ExitCode.USAGE_ERROR)
    assert "--enginecheck-target='nope' is not a target: use one of" in out.stderr
    assert "'toy'" in out.stderr and "'engine_ref'" in out.stderr


def test_a_run_that_selects_nothing_names_the_other_engines_plugins(site: Path, tmp_path: Path) -> None:
    out = pytest_run(tmp_path, site, "--enginecheck-checks=import", "-k", "MyPluginArch", "-m", "enginecheck")
    text = out.stdout + out.stderr
    assert out.returncode == int(pytest.ExitCode.NO_TESTS_COLLECTED), text
    assert ("enginecheck: no check of --enginecheck-target=engine_ref was selected; the vllm target's general "
            "plugins myplugin are installed: their architectures are checked with --enginecheck-target=vllm") in text


def test_a_method_the_target_refuses_makes_no_item_and_is_named_once(site: Path, tmp_path: Path) -> None:
    """vLLM's fp8: a quantization method the target can never run on this install is not an item that always skips,
    but one sentence of the header."""
    out = pytest_run(tmp_path, site, "--enginecheck-target=toyquant", "--enginecheck-checks=quant",
                     "--enginecheck-quant=fp8,int8", "--enginecheck-tp=1", "-rA")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "enginecheck: not offered: quant[fp8] (the toy engine has no fp8 kernel: use int8)" in text
    assert "PASSED enginecheck::GoodForCausalLM::quant[int8,tp=1]" in text
    assert "fp8,tp=" not in text and "2 passed" in text
