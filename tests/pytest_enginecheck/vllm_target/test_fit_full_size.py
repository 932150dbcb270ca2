"""Which full-size config.json budget[tp=N]'s fit uses (no vLLM): ``--enginecheck-full-size-configs`` first, else the
class's ``enginecheck_full_size_config``; bad values are refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_enginecheck.targets.vllm.fit.full_size import (
    FULL_SIZE_CONFIGS,
    FullSizeConfigError,
    full_size_config,
    parse_mapping,
)


class Declared:
    enginecheck_full_size_config = "configs/declared-70b.json"


class Undeclared:
    pass


def test_the_option_takes_pairs_or_a_json_file(tmp_path: Path) -> None:
    assert parse_mapping("") == {}
    assert parse_mapping(" A=a.json, B = dir/b.json ") == {"A": Path("a.json"), "B": Path("dir/b.json")}
    file = tmp_path / "full-size.json"
    file.write_text(json.dumps({"A": "configs/a.json"}))
    assert parse_mapping(str(file)) == {"A": tmp_path / "configs" / "a.json"}  # relative to the file


@pytest.mark.parametrize(("value", "message"), [
    ("A=", "--enginecheck-full-size-configs='A=': give 'LlamaForCausalLM=configs/llama-70b.json,...'"),
    ("nowhere.json", "--enginecheck-full-size-configs='nowhere.json': not a readable JSON file"),
])
def test_a_bad_mapping_names_the_value_and_the_fix(value: str, message: str) -> None:
    with pytest.raises(FullSizeConfigError) as raised:
        parse_mapping(value)
    assert message in str(raised.value)


def test_the_option_wins_over_the_declaration_which_is_relative_to_the_classs_module() -> None:
    assert full_size_config("Declared", {"Declared": Path("given.json")}, Declared) == Path("given.json")
    assert full_size_config("Declared", {}, Declared) == Path(__file__).parent / "configs" / "declared-70b.json"
    assert full_size_config("Undeclared", {}, Undeclared) is None
    assert full_size_config("Undeclared", {}, None) is None


def test_a_declaration_that_is_not_a_path_is_refused() -> None:
    bad = type("Bad", (), {"enginecheck_full_size_config": 70})
    with pytest.raises(FullSizeConfigError, match=r"Bad.enginecheck_full_size_config is 70: set it to the path"):
        full_size_config("Bad", {}, bad)


def test_the_option_is_the_vllm_targets_own() -> None:
    from pytest_enginecheck.targets.vllm import VllmTarget

    assert FULL_SIZE_CONFIGS in VllmTarget.options
    assert FULL_SIZE_CONFIGS.name == "full_size_configs" and FULL_SIZE_CONFIGS.default == ""
