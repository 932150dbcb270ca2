"""The summary's oracle lines: what load[tp=1] and lora[tp=1] each held every architecture's output to, a line per item
that records it (its detail's ``oracle``), counted by kind. Run on a toy target found by its entry point, whose load
and lora checks return the oracle each architecture got, as the engine targets' do."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

TARGET_MODULE = '''
from pytest_enginecheck.targets import ArchEntry, Offer, Target, TargetDescription

# architecture -> (load[tp=1]'s oracle, lora[tp=1]'s oracle)
ORACLES = {"AlphaForCausalLM": ("reference", "reference"), "BetaForCausalLM": ("reference", "self"),
           "GammaForCausalLM": ("none", None)}


class OracleTarget(Target):
    name = "oracletoy"
    label = "Oracle toy"

    def offered(self):
        from pytest_enginecheck.checks import CHECKS

        return Offer(("load", "lora"), tuple((c, "the toy engine only says its oracles") for c in CHECKS
                                            if c not in ("load", "lora")))

    def describe(self, strict=False):
        entries = tuple(ArchEntry(arch, "oracletoy", arch) for arch in ORACLES)
        return TargetDescription(self.spec, self.name, entries, self.offered())

    def check_function(self, check):
        def run(ctx):
            kind = ORACLES[ctx.architecture][check == "lora"]
            if kind is None:
                return {}  # a lora item that records no oracle (an engine_ref lora[tp=N] result, say)
            detail = {"oracle": kind}
            if kind == "reference":
                detail["reference"] = ("the declared toy:BetaReference" if ctx.architecture == "BetaForCausalLM"
                                       else f"transformers' {ctx.architecture}")
            return detail

        return run


def target(spec):
    return OracleTarget(spec)
'''


@pytest.fixture
def site(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A site dir with the toy target's distribution (an entry point in pytest_enginecheck.targets), on PYTHONPATH."""
    site = pytester.mkdir("site")
    (site / "oracletoy_target.py").write_text(textwrap.dedent(TARGET_MODULE))
    info = site / "oracletoy_target-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: oracletoy-target\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pytest_enginecheck.targets]\noracletoy = oracletoy_target:target\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("COLUMNS", "400")  # each oracle line on one line
    return site


def test_the_summary_counts_loras_oracle_beside_loads(pytester: pytest.Pytester, site: Path) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", "--enginecheck-target=oracletoy",
                                           "--enginecheck-checks=load,lora", "--enginecheck-tp=1")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines([
        "load[tp=1] oracle: 2 against a reference implementation (transformers' class of its name, or as named): "
        "AlphaForCausalLM, BetaForCausalLM (the declared toy:BetaReference); 1 compared with nothing (built, loaded "
        "and generated): GammaForCausalLM",
        "lora[tp=1] oracle: 1 against a reference implementation with PEFT's adapter (transformers' class of its name, "
        "or as named): AlphaForCausalLM; 1 self-consistency only (with and without the adapter, TP sizes): "
        "BetaForCausalLM",
    ])


def test_no_lora_line_where_no_lora_item_recorded_an_oracle(pytester: pytest.Pytester, site: Path) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", "--enginecheck-target=oracletoy",
                                           "--enginecheck-checks=load", "--enginecheck-tp=1")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["load[[]tp=1[]] oracle: 2 against a reference implementation*"])
    result.stdout.no_fnmatch_line("lora[[]tp=1[]] oracle:*")
