"""Refusals a CI sees: a run that asks for every check of a target that does not offer some of them here says so at
its end, even under -q; with --enginecheck-fail-on-skip, each refused check of a selected architecture is an item
that fails with the target's reason (exit 1), instead of being dropped. The toy target of
``test_third_party_target`` offers the import check only."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.pytest_enginecheck.test_third_party_target import pytest_run, write_site

TOY_REASON = "the toy engine has no engine to build: only its imports are checked"
REFUSED_ITEMS = ("inspect", "load[tp=1]", "load[tp=2]", "budget[tp=1]", "budget[tp=2]", "startup", "lora[tp=1]",
                 "lora[tp=2]", "quant[fp8,tp=1]", "quant[fp8,tp=2]", "quant[int8,tp=1]", "quant[int8,tp=2]")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_site(tmp_path_factory.mktemp("site"))


def test_a_run_that_drops_refused_checks_says_so_at_its_end_even_under_q(site: Path, tmp_path: Path) -> None:
    out = pytest_run(tmp_path, site, "--enginecheck-target=toy", "-q", "-k", "Good")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "1 passed" in text and "enginecheck: target=" not in text  # -q: no header
    assert (f"enginecheck: not checked (not offered by the toy target here): inspect, load, budget, startup, lora, "
            f"quant ({TOY_REASON}); --enginecheck-fail-on-skip=all (or plugins, or patterns of architectures) makes "
            f"them fail") in text


def test_fail_on_skip_fails_each_refused_check_of_the_architectures_it_selects(site: Path, tmp_path: Path) -> None:
    out = pytest_run(tmp_path, site, "--enginecheck-target=toy", "-q", "-rA", "--enginecheck-fail-on-skip=Good*",
                     "-k", "Good")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "PASSED enginecheck::GoodForCausalLM::import" in text
    for item in REFUSED_ITEMS:
        assert f"FAILED enginecheck::GoodForCausalLM::{item} - " in text, item
        assert (f"\nGoodForCausalLM {item} was not checked (not offered here: {TOY_REASON}), and "
                f"--enginecheck-fail-on-skip selects GoodForCausalLM: run it where the target offers it (the reason "
                f"says how), or name the checks to run with --enginecheck-checks, or leave it out of "
                f"--enginecheck-fail-on-skip.\n") in text, item
    assert f"{len(REFUSED_ITEMS)} failed, 1 passed" in text
    assert "they fail for the architectures --enginecheck-fail-on-skip selects" in text


def test_only_the_selected_architectures_get_failing_refusals(site: Path, tmp_path: Path) -> None:
    """CudaForCausalLM is not selected by the pattern: its refused checks stay dropped (its import fails on its own)."""
    out = pytest_run(tmp_path, site, "--enginecheck-target=toy", "-q", "-rA", "--enginecheck-fail-on-skip=Good*")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "enginecheck::CudaForCausalLM::load" not in text
    assert f"{len(REFUSED_ITEMS) + 1} failed, 1 passed" in text  # Good's refusals, Cuda's import


def test_a_run_that_names_only_offered_checks_asks_for_nothing_refused(site: Path, tmp_path: Path) -> None:
    out = pytest_run(tmp_path, site, "--enginecheck-target=toy", "-q", "--enginecheck-checks=import",
                     "--enginecheck-fail-on-skip=all", "-k", "Good")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "1 passed" in text and "not checked" not in text
