"""Red-team planted bugs (tests/plugin_zoo/zoo/planted_redteam.py) that the zoo.planted session does not carry.

A TP=2 rank that hangs in layer 1's load: load[tp=2] must report the engine's own words (the worker that was not
ready, with its stack), not run out of --enginecheck-timeout in the diagnosis it starts after the failed start, so
that budget[tp=2] and startup, which hang the same way, fold into it (one root cause, one failure). A model that
queries CUDA when built (not when imported) fails load[tp=1] under --enginecheck-strict and passes it without. The
KV-cache oracle (DecodePositionsLlamaForCausalLM) is in the zoo.planted session (test_planted_bugs.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pytest_enginecheck.checks import CheckContext, CheckResult
from pytest_enginecheck.settings import Settings

ZOO = Path(__file__).parents[1] / "plugin_zoo"
SPEC = "zoo.redteam_registry:REGISTRY"
HANG, QUERY = "HangRank1LoadLlamaForCausalLM", "CudaQueryBuildLlamaForCausalLM"
TIMEOUT_S = 12.0  # the engine gives up on the hung worker after 0.8 of it


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CheckResult]:
    """Through ``run_check``: "hang", load[tp=2] of the model whose TP=2 rank 1 hangs in layer 1's weight_loader;
    "strict" and "lenient", load[tp=1] of the model that queries CUDA when built, with and without strict."""
    from engine_ref.isolation import add_preload_modules
    from pytest_enginecheck.checks.runner import run_check
    from pytest_enginecheck.session import CHILD_MODULES

    sys.path.insert(0, str(ZOO))
    add_preload_modules(*CHILD_MODULES)
    workdir = str(tmp_path_factory.mktemp("redteam"))

    def load(arch: str, tp: int, **options: object) -> CheckResult:
        return run_check(CheckContext(check="load", spec=SPEC, architecture=arch, module="zoo.planted_redteam",
                                      class_name=arch, workdir=workdir, tp=tp,
                                      options=Settings(**options)))  # type: ignore[arg-type]
    try:
        return {"hang": load(HANG, tp=2, timeout=TIMEOUT_S), "strict": load(QUERY, tp=1, strict=True),
                "lenient": load(QUERY, tp=1)}
    finally:
        sys.path.remove(str(ZOO))


def test_a_hang_in_load_is_reported_in_the_engines_words(results: dict[str, CheckResult]) -> None:
    hang = results["hang"]
    assert hang.outcome == "failed"
    assert hang.message.startswith(f"{HANG} failed to start at tensor_parallel_size=2: Worker rank 1 was not ready "
                                   f"within 9.6 s"), hang.message
    assert "in weight_loader" in hang.message  # rank 1's stack names where it hangs
    assert "The diagnosis was not run: the check had spent" in hang.message
    assert hang.detail["cause"].startswith("WorkerStartupError: Worker rank 1 was not ready within 9.6 s")
    assert hang.phases["check"] < TIMEOUT_S  # the check's own time (the warm parent's first start is extra)


def test_a_cuda_query_when_built_fails_load_under_strict(results: dict[str, CheckResult]) -> None:
    strict = results["strict"]
    assert (strict.outcome, strict.detail.get("kind")) == ("failed", "cuda_build"), strict.message
    assert strict.message.startswith(f"{QUERY} imports cleanly but queries CUDA while it is built and loaded: it "
                                     f"called torch.cuda.is_available() at ")
    assert "planted_redteam.py" in strict.message and "self.use_fused_kernel = torch.cuda.is_available()" \
        in strict.message
    assert results["lenient"].outcome == "passed", results["lenient"].message
