"""load[tp=2] compares what the model computes, not only its greedy tokens: planted_scaled_shard.py scales rank 1's
shard of layer 1's o_proj by 1.01, which keeps every greedy token of the tiny model (a token-only comparison passed
it), and must fail, naming that o_proj. The final hidden states (RMS-normed, |x| ~ 1) are compared within the
diagnosis's tolerance 1e-4 + 1e-3 |x|: the clean Llama, Qwen2, Mixtral, Qwen3-MoE and Llava differ by at most
2.3e-6 at TP=2."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from pytest_enginecheck.checks import CheckContext, CheckResult

ZOO = Path(__file__).parents[1] / "plugin_zoo"
SPEC = "zoo.planted:REGISTRY"
SCALED, TWIN = "ScaledShardLlamaForCausalLM", "CleanTwinLlamaForCausalLM"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CheckResult]:
    """load[tp=2] of the planted model and its twin, each through ``run_check``."""
    from engine_ref.isolation import add_preload_modules
    from pytest_enginecheck.checks.runner import run_check
    from pytest_enginecheck.session import CHILD_MODULES

    sys.path.insert(0, str(ZOO))  # the zoo, for the check children (started with this process's sys.path)
    add_preload_modules(*CHILD_MODULES)
    workdir = str(tmp_path_factory.mktemp("load-forward"))
    modules = {SCALED: "zoo.planted_scaled_shard", TWIN: "zoo.planted_clean"}
    try:
        return {arch: run_check(CheckContext(check="load", spec=SPEC, architecture=arch, module=module,
                                             class_name=arch, workdir=workdir, tp=2))
                for arch, module in modules.items()}
    finally:
        sys.path.remove(str(ZOO))


def test_a_sharding_bug_that_keeps_the_greedy_tokens_fails_load(results: dict[str, CheckResult]) -> None:
    result = results[SCALED]
    assert (result.outcome, result.detail.get("kind")) == ("failed", "tp_mismatch"), result.message
    assert result.message.startswith(f"At tensor_parallel_size=2, {SCALED} generates the same greedy tokens as at "
                                     f"tensor_parallel_size=1, but other hidden states: {SCALED}'s output in the "
                                     f"prefill of prompt 2 differs by ")
    assert ("above the tolerance 0.0001 + 0.001 |x|. The first module whose output differs between "
            "tensor_parallel_size=1 and 2 is model.layers.1.self_attn.o_proj (RowParallelLinear): its weights do not "
            "reassemble to the TP=1 weights") in result.message
    # and the code that loaded them: engine_ref's own loader (this bug scales the shard after it, in load_weights)
    assert re.search(r"a sharding bug in its weight_loader: its parameters were loaded by LinearBase\.weight_loader "
                     r"\(\S*engine_ref/model_executor/layers/linear\.py:\d+\)\.", result.message), result.message
    assert result.detail["forward_max_difference"] > 10 * 1e-3  # 10x the tolerance at |x| = 1 (RMS-normed)
    assert result.detail["module"] == "model.layers.1.self_attn.o_proj"


def test_the_clean_twin_passes_with_its_forward_compared(results: dict[str, CheckResult]) -> None:
    assert results[TWIN].outcome == "passed", results[TWIN].message
    assert results[TWIN].detail["forward_compared"] == [TWIN, f"{TWIN}.compute_logits"]  # its output, its logits
    assert results[TWIN].detail["forward_max_difference"] < 1e-5  # float32 summation order only
