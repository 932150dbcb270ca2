"""A model vLLM builds with MLA attention (DeepSeek-V2) on vLLM's CPU engine: its MLA backend takes no float32 weights,
so load, budget and startup start it in bfloat16 (``engine.engine_dtype``); load[tp=N] runs TP=N and then skips the
comparison with TP=1, whose bound is derived for float32 (``checks.tp_comparison_skipped``)."""

from __future__ import annotations

import os
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.settings import Settings

MLA = "DeepseekV2ForCausalLM"
DENSE = "LlamaForCausalLM"


def _run(workdir: str, check: str, tp: int) -> dict[str, Any] | str:
    """``check`` of MLA at ``tp`` in this check child: its detail, or ``"CheckFailure: ..."`` / ``"CheckSkip: ..."``."""
    from pytest_enginecheck.targets.vllm.checks import CHECK_FUNCTIONS

    os.environ["VLLM_PLUGINS"] = "clean"  # not the test site's raising plugins (tests/vllm/plugin_dist.py)
    ctx = CheckContext(check=check, spec="vllm", architecture=MLA, module="", class_name="", workdir=workdir, tp=tp,
                       options=Settings(budget_memory="512MiB", timeout=300.0))
    try:
        detail: dict[str, Any] = CHECK_FUNCTIONS[check](ctx)
    except (CheckFailure, CheckSkip) as e:
        return f"{type(e).__name__}: {e}"
    return detail


def _dtypes(workdir: str) -> dict[str, str]:
    """engine_dtype of the checker's tiny checkpoints of MLA and DENSE."""
    from pytest_enginecheck.targets.vllm.checkpoints.tiny import tiny_checkpoint
    from pytest_enginecheck.targets.vllm.describe import registry
    from pytest_enginecheck.targets.vllm.engine.dtype import engine_dtype

    entries = {e.architecture: e for e in registry.list_architectures()}
    dtypes = {}
    for architecture in (MLA, DENSE):
        model_cls = registry.import_model_class(entries[architecture]).model_cls
        dtypes[architecture] = engine_dtype(str(tiny_checkpoint(architecture, workdir, model_cls)))
    return dtypes


def test_vllm_decides_mla_from_the_tiny_config(in_child: Any, tmp_path: Any) -> None:
    assert in_child(_dtypes, str(tmp_path)) == {MLA: "bfloat16", DENSE: "float32"}


def test_an_mla_model_loads_in_bfloat16_and_its_budget_counts_bfloat16_weights(in_child: Any, tmp_path: Any) -> None:
    load = in_child(_run, str(tmp_path), "load", 1)
    assert isinstance(load, dict), load
    assert load["dtype"] == "bfloat16" and len(load["tokens"]) == 3 and all(load["tokens"])
    budget = in_child(_run, str(tmp_path), "budget", 1)  # the same engine start, kept in the workdir
    assert isinstance(budget, dict), budget
    assert budget["dtype"] == "bfloat16"
    # the checkpoint is float32 on disk: the same parameters in bfloat16 take about half its bytes (float32's
    # count would be about all of them)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "vllm-checkpoints" / MLA).glob("*.safetensors"))
    assert 0.3 * on_disk < budget["memory_per_rank"][0]["weights"] < 0.7 * on_disk, (budget, on_disk)


def test_an_mla_model_at_tp2_runs_then_skips_the_float32_comparison(in_child: Any, tmp_path: Any) -> None:
    outcome = in_child(_run, str(tmp_path), "load", 2)
    assert isinstance(outcome, str) and outcome.startswith("CheckSkip: "), outcome
    assert "built, loaded and generated at tensor_parallel_size=2 (bfloat16)" in outcome
    assert "derived for float32" in outcome
