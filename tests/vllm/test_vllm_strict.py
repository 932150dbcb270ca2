"""Issue 32 item 3 on vLLM: under --enginecheck-strict every warm rank, at every TP size, builds and runs its model
with the model's code under the CUDA guard (engine/cuda_ranks.py). Planted in plugin_dist's ``strict_cuda``: layer 1
asking torch.cuda.is_available() in its forward, layer 1 counting the GPUs while built only at TP>1, and their clean
twin, which takes its device from its parameters and asks vLLM's platform (vLLM's own queries, made in every rank,
must pass). Four engine starts in all: each bug fails at its first access (its TP size's start only), the twin runs
at TP=2 and TP=1 (load[tp=2]); about 45 s, 50 s and 95 s on 2 shared cores."""

from __future__ import annotations

from typing import Any

PLUGINS = "strict_cuda"
MODULE = "ectp/models/strict_cuda.py"
MODULE_NAME = "ectp.models.strict_cuda"  # the registry's, as a session's items carry it


def _strict_load(workdir: str, architecture: str, tp: int) -> Any:
    """load[tp=N] of ``architecture`` under --enginecheck-strict (``load_check.load``)."""
    from tests.vllm.load_check import load

    return load(workdir, architecture, tp, PLUGINS, strict=True, module=MODULE_NAME)


def test_load_tp1_under_strict_fails_a_cuda_query_in_layer1s_forward_naming_rank_file_and_line(
        in_child: Any, tmp_path: Any) -> None:
    result = in_child(_strict_load, str(tmp_path), "EctpForwardProbeForCausalLM", 1)
    assert isinstance(result, tuple), result
    message, detail = result
    assert message.startswith("EctpForwardProbeForCausalLM builds cleanly but queries CUDA in its forward: it called "
                              "torch.cuda.is_available() at "), message
    assert f"{MODULE}:{detail['line']} (`if self.ectp_layer1 and torch.cuda.is_available():" in message
    assert "That was rank 0 of 1, in vLLM's execute_model, under --enginecheck-strict's CUDA guard" in message
    assert (detail["kind"], detail["access"], detail["rank"], detail["world_size"]) == ("cuda_forward", "query", 0, 1)
    assert detail["file"].endswith(MODULE) and "traceback" not in detail  # its cause is its kind


def test_load_tp2_under_strict_fails_a_cuda_query_made_while_built_only_at_tp2(in_child: Any, tmp_path: Any) -> None:
    result = in_child(_strict_load, str(tmp_path), "EctpTpBuildProbeForCausalLM", 2, timeout=600.0)
    assert isinstance(result, tuple), result
    message, detail = result
    assert message.startswith("EctpTpBuildProbeForCausalLM imports cleanly but queries CUDA while it is built and "
                              "loaded: it called torch.cuda.device_count() at "), message
    assert f"{MODULE}:{detail['line']} (`self.ectp_gpus = torch.cuda.device_count()" in message
    assert f"That was rank {detail['rank']} of 2, in vLLM's load_model" in message  # each rank makes it; first wins
    assert (detail["kind"], detail["access"], detail["world_size"]) == ("cuda_build", "query", 2)


def test_the_clean_twin_passes_load_tp2_under_strict_at_both_sizes(in_child: Any, tmp_path: Any) -> None:
    """Its device from its parameters, and vLLM's platform asked, at build and in forward; vLLM's own torch.cuda
    queries in every rank (its sampler, Triton's driver probe) pass: TP=2 and TP=1 start, generate and agree."""
    detail = in_child(_strict_load, str(tmp_path), "EctpDeviceTwinForCausalLM", 2, timeout=600.0)
    assert isinstance(detail, dict), detail
    assert detail["tensor_parallel_size"] == 2 and detail["start_mode"] == "warm", detail
    assert detail["max_logprob_difference"] <= detail["logprob_tolerance"], detail
