"""The table of checks (``checks.CHECK_SPECS``) is what registration, item names, roots, the options' help and the
table in docs/checks.md derive from: none of them can drift from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pytest_enginecheck.checks import CHECK_SPECS, CHECKS, SPECS, CheckContext, item_name, markdown_table, roots
from pytest_enginecheck.options import HELP, option_help
from pytest_enginecheck.targets import declared_options

CHECKS_PAGE = Path(__file__).parents[2] / "docs" / "checks.md"  # the README links it


def test_the_docs_table_is_the_spec_table() -> None:
    assert markdown_table() in CHECKS_PAGE.read_text(), (
        "docs/checks.md's table differs from CHECK_SPECS: paste `python -m pytest_enginecheck.checks` into it")
    out = subprocess.run([sys.executable, "-m", "pytest_enginecheck.checks"], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == markdown_table()
    for spec in CHECK_SPECS:
        assert f"| `{spec.item_pattern()}` |" in markdown_table()


def test_the_help_lists_every_check() -> None:
    for check in CHECKS:
        assert check in HELP["enginecheck"], check
        assert check in HELP["checks"], check


def test_each_options_help_names_the_checks_that_read_it() -> None:
    assert option_help("budget_memory").endswith("; read by the budget check")
    assert option_help("tp").endswith("; read by the load, budget, startup, lora, quant checks")
    assert option_help("json") == HELP["json"]
    targets_own = {option.name for option in declared_options()}  # a target's own (Target.options): inspect
    for spec in CHECK_SPECS:
        assert all(option in HELP or option in targets_own for option in spec.options), spec
    assert option_help("inspect", "how").endswith("how; read by the inspect check")


@pytest.mark.parametrize("spec", CHECK_SPECS, ids=lambda s: s.name)
def test_item_names_and_roots_follow_the_spec(spec: object) -> None:
    name = getattr(spec, "name")  # noqa: B009 - parametrised over CheckSpec
    ctx = CheckContext(check=name, spec="engine_ref", architecture="A", module="m", class_name="A", workdir="/w",
                       tp=2, quantization="fp8" if SPECS[name].per_method else None, plugin="p")
    item = item_name(ctx)
    assert item == {"quant": "quant[fp8,tp=2]", "load": "load[tp=2]", "budget": "budget[tp=2]",
                    "lora": "lora[tp=2]"}.get(name, name)
    expected = {"": (), "import": ("import",),
                "build": ("import", "inspect", "load[tp=1]", *(() if name == "load" else ("load[tp=2]",)))
                }[SPECS[name].roots]
    assert roots(ctx) == expected
    assert (roots(ctx) == ()) == (name in ("plugins", "import")), "only the roots themselves have no root"
