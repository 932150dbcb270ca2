"""The vLLM tier cannot go green having run nothing: where vLLM is missing (this venv), its tests skip,
unless ``ENGINECHECK_REQUIRE_VLLM=1`` (the README's ``# vLLM tier`` command sets it) makes that an error."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TIER_FILE = Path(__file__).parents[1] / "vllm" / "test_vllm_registry.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                                reason="vLLM is importable here: the tier runs instead of skipping")


def test_the_tier_skips_without_vllm(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINECHECK_REQUIRE_VLLM", raising=False)
    result = pytester.runpytest_subprocess(str(TIER_FILE), "-p", "no:cacheprovider", "-q")
    assert result.ret == pytest.ExitCode.OK
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) > 0 and set(outcomes) <= {"skipped"}, outcomes


def test_a_missing_vllm_is_an_error_where_the_tier_requires_it(pytester: pytest.Pytester,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINECHECK_REQUIRE_VLLM", "1")
    result = pytester.runpytest_subprocess(str(TIER_FILE), "-p", "no:cacheprovider", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ENGINECHECK_REQUIRE_VLLM=1 but vLLM is not importable by *"])


def test_the_readme_tier_commands_require_vllm_and_split_the_tier_in_two() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text().splitlines()
    # CI's (the line .ci/run's readme_command runs) and the registry's
    ci, registry = (readme[readme.index(f"# {name}") + 1] for name in ("vLLM tier", "vLLM registry tier"))
    for command in (ci, registry):
        assert "ENGINECHECK_REQUIRE_VLLM=1 " in command and "tests/vllm" in command, command
    assert '-m "not registry"' in ci and " -m registry " in registry  # together, every test of the tier


def test_the_readme_sglang_tier_command_requires_sglang(pytester: pytest.Pytester,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text().splitlines()
    command = readme[readme.index("# SGLang tier") + 1]
    assert "ENGINECHECK_REQUIRE_SGLANG=1 " in command and "tests/sglang" in command
    if importlib.util.find_spec("sglang") is None:  # and without SGLang, that requirement is an error
        monkeypatch.setenv("ENGINECHECK_REQUIRE_SGLANG", "1")
        tier = Path(__file__).parents[1] / "sglang"
        result = pytester.runpytest_subprocess(str(tier), "-p", "no:cacheprovider", "-q")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(["ERROR: ENGINECHECK_REQUIRE_SGLANG=1 but SGLang is not importable by *"])


def test_every_registry_entry_names_a_test_of_the_tier() -> None:
    """A renamed test would otherwise leave its REGISTRY entry matching nothing (and move to CI's tier unseen)."""
    from tests.vllm.conftest import REGISTRY

    tier = Path(__file__).parents[1] / "vllm"
    collected = subprocess.run([sys.executable, "-m", "pytest", str(tier), "--collect-only", "-q", "-m", "registry",
                                "-p", "no:cacheprovider"], capture_output=True, text=True, timeout=120,
                               cwd=tier.parents[1])
    marked = [line.split("/")[-1] for line in collected.stdout.splitlines() if "::" in line]
    unmatched = [entry for entry in REGISTRY if not any(node.startswith(entry) for node in marked)]
    assert marked and not unmatched, (unmatched, collected.stdout[-2000:], collected.stderr[-2000:])
