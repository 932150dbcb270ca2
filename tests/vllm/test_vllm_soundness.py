"""Issue 17 on the vLLM target: planted bugs (plugin_dist) the vLLM checks must catch, and their clean twins."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.settings import Settings


def _load(workdir: str, architecture: str, tp: int, plugins: str = "clean,layer1_shard") -> Any:
    """load[tp=N] of ``architecture`` from the test plugins (``load_check.load``)."""
    from tests.vllm.load_check import load

    return load(workdir, architecture, tp, plugins)


def test_load_tp2_names_the_layer1_down_proj_that_keeps_rank0s_columns(in_child: Any, tmp_path: Any) -> None:
    result = in_child(_load, str(tmp_path), "EctpLayer1ShardForCausalLM", 2, timeout=900.0)  # 4 starts on 2 cores
    assert isinstance(result, tuple), result
    message, detail = result
    assert message.startswith("EctpLayer1ShardForCausalLM at tensor_parallel_size=2 generates other greedy tokens")
    assert "\n" not in message  # CI logs cut FAILED lines: the module is named on the first
    assert ("The first module whose output differs between tensor_parallel_size=1 and 2 is "
            "model.layers.1.mlp.down_proj (RowParallelLinear): its output differs by ") in message
    assert "its input agrees" in message
    assert "model.layers.1.mlp.down_proj's weight shards are wrong (a sharding bug in its weight_loader" in message
    assert "could not be compared" not in message  # every module before it was put back together and compared
    assert detail["diagnosis"] in message


def test_load_tp2_passes_the_clean_twin_without_a_diagnosis(in_child: Any, tmp_path: Any) -> None:
    detail = in_child(_load, str(tmp_path), "EctpCleanForCausalLM", 2)
    assert isinstance(detail, dict), detail
    assert "diagnosis" not in detail and detail["tensor_parallel_size"] == 2


def test_load_tp1_holds_a_model_to_the_reference_it_declares(in_child: Any, tmp_path: Any) -> None:
    """A norm weight 1 % too large in layer 1, the same in every run, fails load[tp=1] against transformers' Llama
    (the reference the class declares); its clean twin passes held to it, and vLLM's own Llama to its own name's."""
    bug = in_child(_load, str(tmp_path), "EctpNormScaleForCausalLM", 1, plugins="reference_bug")
    assert isinstance(bug, tuple), bug
    message, detail = bug
    assert message.startswith("EctpNormScaleForCausalLM at tensor_parallel_size=1 does not compute what "
                              "transformers' LlamaForCausalLM computes on the same tiny checkpoint"), message
    assert detail["kind"] == "reference_mismatch" and detail["oracle"] == "reference"
    twin = in_child(_load, str(tmp_path), "EctpRefTwinForCausalLM", 1, plugins="reference_bug")
    assert isinstance(twin, dict), twin
    assert twin["oracle"] == "reference" and twin["reference"] == "transformers' LlamaForCausalLM"
    assert twin["deterministic_seeds"] == [0, 1] and twin["max_seed_difference"] <= 1e-4, twin
    assert twin["max_reference_difference"] < 1e-5
    llama = in_child(_load, str(tmp_path), "LlamaForCausalLM", 1, plugins="reference_bug")
    assert isinstance(llama, dict) and llama["reference"] == "transformers' LlamaForCausalLM", llama


def test_an_out_of_tree_class_declares_the_config_field_it_reads_and_its_own_reference(in_child: Any,
                                                                                        tmp_path: Any) -> None:
    """A Llama subclass reading a config field Llama's config has not: declared (enginecheck_config, and its reference
    in enginecheck_reference), load[tp=1] runs on a checkpoint with the field and holds it to the author's class;
    undeclared, no checkpoint can be made and the skip says what to declare (no silent green: fail-on-skip fails it)."""
    declared = in_child(_load, str(tmp_path), "EctpDeclaredForCausalLM", 1, plugins="declared")
    assert isinstance(declared, dict), declared
    assert declared["oracle"] == "reference", declared
    assert declared["reference"] == "the declared ectp.reference:ScaledLogitsLlama", declared
    assert declared["max_reference_difference"] < 1e-5, declared
    undeclared = in_child(_load, str(tmp_path), "EctpUndeclaredForCausalLM", 1, plugins="declared")
    assert isinstance(undeclared, str), undeclared
    assert "ectp_logit_scale" in undeclared and "enginecheck_config" in undeclared, undeclared


@pytest.mark.parametrize(("architecture", "reference"), [
    ("EctpDerivedScaleForCausalLM", "transformers' LlamaForCausalLM"),
    ("EctpUnscaledRopeForCausalLM", "transformers' LlamaForCausalLM"),
    ("EctpNoWindowGemma2ForCausalLM", "transformers' Gemma2ForCausalLM"),
])
def test_load_tp1_fails_what_a_uniform_tiny_config_cannot_show(in_child: Any, tmp_path: Any, architecture: str,
                                                                reference: str) -> None:
    """Issue 31 item 4: a softmax scale from hidden_size // heads (layer 1), a rope scaling dropped (layer 1), a sliding
    window ignored (Gemma 2) each build the correct model on a tiny config whose head_dim is hidden/heads, with no rope
    scaling and no window; on the family's tiny config (head_dim 64 beside hidden 64 over 2 heads, llama3 scaling,
    window 16 on the sliding layers) load[tp=1] fails each against the reference it declares. Measured: the scale
    1.4e-3, the rope 2.7e-3 (the clean twins 1e-6)."""
    bug = in_child(_load, str(tmp_path), architecture, 1, plugins="config_bugs")
    assert isinstance(bug, tuple), bug
    message, detail = bug
    assert message.startswith(f"{architecture} at tensor_parallel_size=1 does not compute what {reference} computes "
                              f"on the same tiny checkpoint"), message
    assert detail["kind"] == "reference_mismatch" and detail["oracle"] == "reference", detail
    from pytest_enginecheck.targets.vllm.checks.reference import ORACLE_TOLERANCE

    assert detail["max_reference_difference"] > 10 * ORACLE_TOLERANCE, detail  # not a rounding at the bound


def test_load_tp1_passes_a_gemma2_that_keeps_its_sliding_window(in_child: Any, tmp_path: Any) -> None:
    """The window bug's clean twin: Gemma 2's tiny config with its sliding window (which transformers' Gemma 2 needs:
    with none it could not run, and Gemma 2 had no reference) agrees with transformers' Gemma 2."""
    twin = in_child(_load, str(tmp_path), "EctpGemma2TwinForCausalLM", 1, plugins="config_bugs")
    assert isinstance(twin, dict), twin
    assert twin["oracle"] == "reference" and twin["reference"] == "transformers' Gemma2ForCausalLM", twin
    assert twin["max_reference_difference"] < 1e-5, twin


def test_load_tp1_fails_a_model_whose_output_depends_on_torchs_generators(in_child: Any, tmp_path: Any) -> None:
    """Noise on the final hidden states, the same in every run under the engine's seed: the engine's second run after
    reseeding torch gives other log-probabilities, so load[tp=1] fails it as nondeterministic (the clean twins of the
    other tests record their seeds agreeing)."""
    bug = in_child(_load, str(tmp_path), "EctpNoiseForCausalLM", 1, plugins="noise")
    assert isinstance(bug, tuple), bug
    message, detail = bug
    assert message.startswith("EctpNoiseForCausalLM is nondeterministic at tensor_parallel_size=1 (float32): the "
                              "same engine, generating the same prompts again after torch was reseeded (0, then 1), "
                              "gives "), message
    assert detail["kind"] == "nondeterministic" and detail["seeds"] == [0, 1]


def _captures(tp: int, modules: dict[str, tuple[dict[str, Any], Any, list[Any]]]) -> tuple[Any, list[Any]]:
    """TP=1's and the ranks' RankCaptures of ``{name: (rank layout, TP=1 output, rank outputs)}``, in order."""
    from pytest_enginecheck.targets.vllm.checks.diagnosis import RankCapture

    one, ranks = RankCapture(rank=0), [RankCapture(rank=r) for r in range(tp)]
    for name, (layout, full, parts) in modules.items():
        for capture, output in zip([one, *ranks], [full, *parts], strict=True):
            capture.order.append(name)
            capture.outputs[name] = output
            capture.classes[name] = "Module"
            capture.layouts[name] = layout if capture is not one else {"style": "whole"}
    return one, ranks


def test_compare_reports_the_modules_it_could_not_compare_before_the_first_that_differs() -> None:
    import torch

    from pytest_enginecheck.targets.vllm.checks.diagnosis import compare

    x = torch.arange(12.0).reshape(3, 4)
    one, ranks = _captures(2, {
        "model.layers.0.odd": ({"style": "shape"}, x, [x[:, :3], x[:, :3]]),  # widths 3 + 3 never make 4
        "model.layers.1.mlp.down_proj": ({"style": "partial"}, x, [x / 2, x / 2 + 1]),
    })
    message = compare(one, ranks, 2)
    assert message.startswith("The first module whose output differs between tensor_parallel_size=1 and 2 is "
                              "model.layers.1.mlp.down_proj (Module): its output differs by 1 (max abs; the sum of "
                              "the ranks' partial outputs)")
    assert ("Before it, 1 module(s) could not be compared, so the difference may begin there: model.layers.0.odd "
            "(its ranks' output shapes [(3, 3), (3, 3)] do not reassemble to the TP=1 shape (3, 4))") in message


def test_compare_puts_qkv_back_together_with_its_replicated_kv_heads() -> None:
    import torch

    from pytest_enginecheck.targets.vllm.checks.diagnosis import compare

    q, k, v = torch.randn(5, 8), torch.randn(5, 2), torch.randn(5, 2)  # 4 query heads, 1 KV head, TP=2
    qkv = {"style": "column", "partitions": [4, 2, 2], "replicas": [1, 2, 2]}
    ranks_out = [torch.cat([q[:, :4], k, v], -1), torch.cat([q[:, 4:], k, v], -1)]
    one, ranks = _captures(2, {"model.layers.1.self_attn.qkv_proj": (qkv, torch.cat([q, k, v], -1), ranks_out)})
    assert compare(one, ranks, 2).startswith("No module's output differs between tensor_parallel_size=1 and 2 in "
                                             "one forward of the prompt (1 compared).")


def test_compare_tells_a_wrong_collective_from_a_wrong_weight_shard() -> None:
    import torch

    from pytest_enginecheck.targets.vllm.checks.diagnosis import compare

    x, full = torch.randn(3, 8), torch.randn(3, 4)
    parts = [full / 2, full / 2]  # the ranks' own products add up to TP=1's output ...
    row = {"style": "whole", "how": "all-reduced", "local": {"style": "partial"}}
    one, ranks = _captures(2, {"model.layers.1.mlp.down_proj": (row, full, [full / 2, full / 2])})  # ... unreduced
    for capture, inp in zip([one, *ranks], [x, x[:, :4], x[:, 4:]], strict=True):
        capture.inputs["model.layers.1.mlp.down_proj"] = inp
    for rank, part in zip(ranks, parts, strict=True):
        rank.local["model.layers.1.mlp.down_proj"] = part
    message = compare(one, ranks, 2)
    assert "while its input agrees; its ranks' own products make the TP=1 output, its output after the collective " \
           "does not: a missing or extra collective" in message


def _strict_import_after_preload(workdir: str, architecture: str, preloaded: list[str], strict_preload: bool) -> str:
    """The warm parent's preload of ``preloaded`` (targets.vllm.describe.warm, as under --enginecheck-strict or not),
    then the strict import check of ``architecture``: "passed" or the failure's message."""
    import os

    from pytest_enginecheck.targets.vllm.checks.import_check import run_import
    from pytest_enginecheck.targets.vllm.describe.warm import preload

    os.environ["VLLM_PLUGINS"] = "gpu_probe"
    assert preload(preloaded, strict=strict_preload) == preloaded
    ctx = CheckContext(check="import", spec="vllm", architecture=architecture, module="", class_name="",
                       workdir=workdir, options=Settings(strict=True))
    try:
        run_import(ctx)
    except CheckFailure as e:
        return e.message
    return "passed"


def test_strict_import_sees_the_query_of_a_preloaded_shared_helper(in_child: Any, tmp_path: Any) -> None:
    """Item 6: the helper (queries is_available() at import) is in the warm parent's preload; a non-strict preload
    hid its query from --enginecheck-strict (the check passed)."""
    message = in_child(_strict_import_after_preload, str(tmp_path), "EctpGpuProbeForCausalLM",
                       ["ectp.models.gpu_probe"], True)
    assert message.startswith("Importing ectp.models.gpu_probe_model queried CUDA: it called "
                              "torch.cuda.is_available() at "), message
    assert "ectp/models/gpu_probe.py:3 (`HAS_GPU = torch.cuda.is_available()`)" in message
    assert "Import chain: ectp.models.gpu_probe_model -> ectp.models.gpu_probe." in message


def test_strict_import_does_not_blame_a_helper_that_asks_only_when_called(in_child: Any, tmp_path: Any) -> None:
    """The twin: its helper asks inside a cached function, so it passes. (vLLM 0.32's own import path queries too,
    via triton's driver probe: that is the engine's, never blamed on the model; see guard.CudaGuard.)"""
    message = in_child(_strict_import_after_preload, str(tmp_path), "EctpLazyProbeForCausalLM",
                       ["ectp.models.lazy_probe"], True)
    assert message == "passed"


def _load_token_only_then_logprobs(workdir: str, architecture: str) -> tuple[Any, Any]:
    """load[tp=2] of ``architecture`` judged first by the greedy tokens alone (the tolerance lifted, as the check was
    before it compared log-probabilities), then as it is; the second reuses the first's engine runs (cached in
    ``workdir``). Each: the passing detail, or (message, detail) of the failure."""
    import os

    from pytest_enginecheck.targets.vllm.checks import load

    os.environ["VLLM_PLUGINS"] = "clean,scaled_shard"
    ctx = CheckContext(check="load", spec="vllm", architecture=architecture, module="", class_name="",
                       workdir=workdir, tp=2, options=Settings(budget_memory="512MiB", timeout=300.0))
    results = []
    for tolerance in (float("inf"), load.LOGPROB_TOLERANCE):
        load.LOGPROB_TOLERANCE, kept = tolerance, load.LOGPROB_TOLERANCE
        try:
            results.append(load.run_load(ctx))
        except CheckFailure as e:
            results.append((e.message, e.detail))
        finally:
            load.LOGPROB_TOLERANCE = kept
    return results[0], results[1]


def test_load_tp2_catches_a_sharding_bug_that_keeps_the_greedy_tokens(in_child: Any, tmp_path: Any) -> None:
    """Layer 1's o_proj scales rank 1's input columns by 1.01: every greedy token stays (the token comparison alone
    passes it), the log-probabilities move by ~1.6e-3, 15x the tolerance, and the diagnosis names the module."""
    token_only, result = in_child(_load_token_only_then_logprobs, str(tmp_path), "EctpScaledShardForCausalLM",
                                  timeout=900.0)
    assert isinstance(token_only, dict), token_only  # what the token-only check said: a pass
    assert isinstance(result, tuple), result
    message, detail = result
    assert message.startswith("EctpScaledShardForCausalLM at tensor_parallel_size=2 generates the same greedy "
                              "tokens but other log-probabilities than at tensor_parallel_size=1 (float32): max "
                              "difference "), message
    assert "\n" not in message
    assert f"above tolerance {detail['logprob_tolerance']:g}. The first module whose output differs between " \
           f"tensor_parallel_size=1 and 2 is model.layers.1.self_attn.o_proj (RowParallelLinear)" in message
    assert "model.layers.1.self_attn.o_proj's weight shards are wrong" in message
    assert detail["max_logprob_difference"] > 10 * detail["logprob_tolerance"]


def test_load_tp2_logprobs_of_the_clean_twin_sit_far_below_the_tolerance(in_child: Any, tmp_path: Any) -> None:
    """The clean twin at TP=2 differs from TP=1 only in float32 summation order: measured ~1e-6, 100x below."""
    token_only, result = in_child(_load_token_only_then_logprobs, str(tmp_path), "EctpCleanForCausalLM")
    assert isinstance(token_only, dict) and isinstance(result, dict), result
    assert "logprobs_not_compared" not in result, result
    assert result["max_logprob_difference"] <= result["logprob_tolerance"] / 10, result
