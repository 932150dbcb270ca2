"""The load check's determinism run and the TP diagnosis's uncomparable modules.

Two planted models (tests/plugin_zoo/zoo): planted_rng.py, whose layer-1 MLP adds ``torch.randn_like`` noise (TP=1
and TP=2 agree, being seeded alike), must fail load[tp=1] and load[tp=2] as nondeterministic, naming that MLP;
planted_diag.py, whose layer-1 activation returns a padded layout and is wrong at TP=2, must be named as the first
module that could not be compared, before the down_proj whose output differs after it. Their clean twin passes.
The results are the zoo.planted session's (tests/zoo_sessions.py, shared with test_planted_bugs), except
planted_rng's load[tp=2]: folded there into its load[tp=1], it runs here on its own. The comparison itself is
tested on Captures built here, and a diagnosis that fails must say so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pytest_enginecheck.checks import CheckContext, CheckResult
from pytest_enginecheck.prompts import prompt_lengths
from pytest_enginecheck.settings import Settings
from pytest_enginecheck.targets.engine_ref.tiny_engine import BLOCK_SIZE, MAX_MODEL_LEN, MAX_TOKENS
from pytest_enginecheck.targets.engine_ref.tp_explain import Capture, compare, explain_seeds, explain_tp
from tests.zoo_sessions import PLANTED, zoo_session

# the fixture that reads a shared zoo session -> its name (started early: tests/zoo_sessions.py)
ZOO_SESSIONS = {"results": "planted"}

ZOO = Path(__file__).parents[1] / "plugin_zoo"
SPEC = "zoo.planted:REGISTRY"
RNG, DIAG, TWIN = "RngMLPLlamaForCausalLM", "PaddedActLlamaForCausalLM", "CleanTwinLlamaForCausalLM"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], CheckResult]:
    """load[tp=1] and load[tp=2] of the two planted models and their twin: the zoo.planted session's, and
    planted_rng's load[tp=2] (folded there into its load[tp=1] as the same cause) through ``run_check``."""
    from engine_ref.isolation import add_preload_modules
    from pytest_enginecheck.checks.runner import run_check
    from pytest_enginecheck.session import CHILD_MODULES

    assert f"--enginecheck-target={SPEC}" in PLANTED
    session = zoo_session(tmp_path_factory, "planted", *PLANTED).results
    results = {(arch, tp): CheckResult(**session[arch, f"load[tp={tp}]"])
               for arch in (RNG, DIAG, TWIN) for tp in (1, 2)}
    assert results[RNG, 2].detail["root"] == f"enginecheck::{RNG}::load[tp=1]", results[RNG, 2].message
    sys.path.insert(0, str(ZOO))  # the zoo, for the check children (started with this process's sys.path)
    add_preload_modules(*CHILD_MODULES)
    try:
        results[RNG, 2] = run_check(CheckContext(check="load", spec=SPEC, architecture=RNG, module="zoo.planted_rng",
                                                 class_name=RNG, workdir=str(tmp_path_factory.mktemp("determinism")),
                                                 tp=2))
    finally:
        sys.path.remove(str(ZOO))
    return results


@pytest.mark.parametrize("tp", [1, 2])
def test_a_forward_that_draws_random_numbers_is_nondeterministic(
        results: dict[tuple[str, int], CheckResult], tp: int) -> None:
    result = results[RNG, tp]
    assert (result.outcome, result.detail.get("kind")) == ("failed", "nondeterministic"), result.message
    assert result.message.startswith(f"{RNG} is nondeterministic: Two runs at tensor_parallel_size=1 that differ "
                                     f"only in the seed (0 and 1) generate different tokens")
    assert ("The first module whose output changes between seeds 0 and 1 is model.layers.1.mlp (NoisyMLP)"
            in result.message)
    assert "so its own forward changes with the seed: it draws random numbers" in result.message
    assert result.detail["module"] == "model.layers.1.mlp"


def test_an_uncomparable_module_is_named_before_the_later_difference(
        results: dict[tuple[str, int], CheckResult]) -> None:
    assert results[DIAG, 1].outcome == "passed", results[DIAG, 1].message
    message = results[DIAG, 2].message
    assert results[DIAG, 2].detail["kind"] == "tp_mismatch", message
    i = next(i for i, (a, b) in enumerate(zip(results[DIAG, 2].detail["outputs"], results[DIAG, 2].detail["reference"],
                                               strict=True)) if a != b)
    n = prompt_lengths(BLOCK_SIZE, MAX_MODEL_LEN, MAX_TOKENS)[i]  # the hooked prefill: the first prompt that differs
    assert ("The first module that could not be compared between tensor_parallel_size=1 and 2 is "
            f"model.layers.1.mlp.act_fn (PaddedSiluAndMul): its outputs there (shapes [({n}, 96), ({n}, 96)]) cannot "
            f"be put back together into its reference output ({n}, 144)") in message
    later = message.index("After it, the first module whose output differs is model.layers.1.mlp.down_proj")
    assert later > message.index("model.layers.1.mlp.act_fn")
    assert message.endswith("or its input already differs (model.layers.1.mlp.act_fn runs before it).")


@pytest.mark.parametrize("tp", [1, 2])
def test_the_clean_twin_passes_with_its_determinism_run(results: dict[tuple[str, int], CheckResult],
                                                        tp: int) -> None:
    result = results[TWIN, tp]
    assert result.outcome == "passed", result.message
    assert result.detail["deterministic_seeds"] == [0, 1]


def test_a_diagnosis_that_fails_says_so(tmp_path: Path) -> None:
    """A checkpoint directory without config.json: the hooked TP=1 run raises, and the sentence carries that."""
    from pytest_enginecheck.targets.engine_ref.load_check import _diagnosis

    ctx = CheckContext(check="load", spec="engine_ref", architecture="LlamaForCausalLM", module="", class_name="",
                       workdir=str(tmp_path), tp=2, options=Settings(timeout=30.0))
    diagnosis = _diagnosis(ctx, tmp_path, [3, 10, 17])
    assert diagnosis.module is None
    assert diagnosis.text.startswith("The diagnosis failed (MultirankError: rank 0 of 1 failed: "
                                     f"engine_ref.errors.ConfigError: model='{tmp_path}' has no config.json"
                                     ), diagnosis.text
    assert diagnosis.text.endswith("so it names no module. Hint: check the weight_loader and the collectives of "
                                   "the layers this model changed.")


def run(*outputs: tuple[str, torch.Tensor | str], cls: str = "Mod") -> Capture:
    """A Capture of module calls in finish order: a tensor output, or the type name of an unreadable one."""
    c = Capture()
    for key, out in outputs:
        c.order.append(key)
        c.classes[key] = cls
        if isinstance(out, str):
            c.unreadable[key] = out
        else:
            c.outputs[key] = out
    return c


def test_the_walk_goes_on_past_an_uncomparable_call_and_lists_it() -> None:
    x = torch.ones(3, 8)
    one = run(("a", x), ("b", torch.ones(3, 12)), ("c", "dict"), ("d", x))
    ranks = [run(("a", x), ("b", torch.ones(3, 5)), ("c", "dict"), ("d", 2 * x)) for _ in range(2)]
    c = compare(one, ranks)
    assert [key for key, _ in c.uncomparable] == ["b", "c"]
    assert "shapes [(3, 5), (3, 5)]" in c.uncomparable[0][1] and "a dict, which holds no tensor" in c.uncomparable[1][1]
    assert (c.differs, c.max_abs_diff) == ("d", 1.0)
    text = explain_tp(one, ranks, 2).text
    assert text.startswith("The first module that could not be compared between tensor_parallel_size=1 and 2 is b "
                           "(Mod): ") and "(1 more module call after it could not be compared either)" in text


def test_no_difference_found_is_said_with_a_hint() -> None:
    x = torch.ones(3, 8)
    diagnosis = explain_tp(run(("a", x)), [run(("a", x)), run(("a", x))], 2)
    assert diagnosis.module is None
    assert diagnosis.text.startswith("No module's output differs between tensor_parallel_size=1 and 2")
    assert "Hint: check the weight_loader" in diagnosis.text


def test_two_seeds_must_agree_exactly() -> None:
    x = torch.ones(3, 8)
    assert explain_seeds(run(("a", x), ("b", x)), run(("a", x.clone()), ("b", x.clone())), (0, 1)) is None
    finding = explain_seeds(run(("a", x), ("b", x)), run(("a", x), ("b", x + 1e-6)), (0, 1))
    assert finding is not None and finding.module == "b"
    reshaped = explain_seeds(run(("a", x)), run(("a", torch.ones(3, 9))), (0, 1))
    assert reshaped is not None and "has shape (3, 8) under seed 0 and (3, 9) under seed 1" in reshaped.text
