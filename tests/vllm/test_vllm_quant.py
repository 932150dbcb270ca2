"""quant[METHOD,tp=N] on the vLLM target (issue 19 item 4): the checkpoint layout, planted scale bugs the local
oracle must catch (plugin_dist's quant_scale and quant_shard), their clean twin, and the real families."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.settings import Settings

RUN_TIMEOUT_S = 1500


def test_pack_int4_is_compressed_tensors_layout() -> None:
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from pytest_enginecheck.targets.vllm.checkpoints.quantized import pack_int4

    q = torch.randint(-8, 8, (64, 96), dtype=torch.int8)
    assert torch.equal(pack_int4(q), pack_to_int32(q, 4, packed_dim=1))


def test_quantization_config_is_compressed_tensors_own() -> None:
    from compressed_tensors.quantization import QuantizationConfig

    from pytest_enginecheck.targets.vllm.checkpoints.quantized import METHODS

    for scheme in METHODS.values():
        config = QuantizationConfig.model_validate(scheme.quantization_config())
        assert config.format == scheme.format and config.config_groups["group_0"].weights.num_bits in (4, 8)


def _quant(workdir: str, architecture: str, method: str, tps: tuple[int, ...]) -> dict[int, Any]:
    """quant[method,tp=N] of ``architecture`` from the test plugins, per TP size: the passing detail, or
    (message, detail) of the failure, or ("skipped", reason)."""
    import os

    from pytest_enginecheck.targets.vllm.checks import CHECK_FUNCTIONS

    os.environ["VLLM_PLUGINS"] = "clean,quant_scale,quant_shard,quant_expert"
    results: dict[int, Any] = {}
    for tp in tps:
        ctx = CheckContext(check="quant", spec="vllm", architecture=architecture, module="", class_name="",
                           workdir=workdir, tp=tp, quantization=method, options=Settings(timeout=300.0))
        try:
            results[tp] = CHECK_FUNCTIONS["quant"](ctx)
        except CheckFailure as e:
            results[tp] = (e.message, e.detail)
        except CheckSkip as e:
            results[tp] = ("skipped", str(e))
    return results


def _needs_kernel(*methods: str) -> None:
    """Skip, naming it, where this CPU's vLLM build lacks a method's kernel (the check then skips:
    test_quant_skips_where_the_cpu_build_lacks_the_kernel)."""
    from pytest_enginecheck.targets.vllm.checks.quant import missing_kernel

    missing = [kernel for method in methods if (kernel := missing_kernel(method)) is not None]
    if missing:
        pytest.skip(f"vLLM's CPU build here has no {', '.join(missing)} kernel (no AVX-512)")


def _quant_skip(workdir: str, method: str) -> str:
    from pytest_enginecheck.targets.vllm.checks.quant import run

    ctx = CheckContext(check="quant", spec="vllm", architecture="LlamaForCausalLM", module="", class_name="",
                       workdir=workdir, tp=1, quantization=method,
                       options=Settings(budget_memory="512MiB", timeout=300.0))
    try:
        run(ctx)
    except CheckSkip as e:
        return str(e)
    return "the check ran"


@pytest.mark.parametrize("method", ["int8", "w4a16"])
def test_quant_skips_where_the_cpu_build_lacks_the_kernel(in_child: Any, tmp_path: Any, method: str) -> None:
    from pytest_enginecheck.targets.vllm.checks.quant import KERNELS, missing_kernel

    if missing_kernel(method) is None:
        pytest.skip(f"this CPU's vLLM build has {KERNELS[method]}: the quant tests below run the check")
    message = in_child(_quant_skip, str(tmp_path), method)
    assert message.startswith(f"quant[{method}] cannot run here: vLLM's CPU build for this CPU has no "
                              f"{KERNELS[method]} kernel"), message


@pytest.mark.parametrize("method", ["int8", "w4a16"])
def test_quant_tp1_names_layer1_down_proj_whose_scale_is_5_percent_off(in_child: Any, tmp_path: Any,
                                                                     method: str) -> None:
    _needs_kernel(method)
    results = in_child(_quant, str(tmp_path), "EctpQuantScaleForCausalLM", method, (1,), timeout=900.0)
    assert isinstance(results[1], tuple), results
    message, detail = results[1]
    assert message.startswith(f"The {method} layer model.layers.1.mlp.down_proj of EctpQuantScaleForCausalLM at "
                              f"tensor_parallel_size=1 (rank 0, "), message
    assert "\n" not in message
    worst = detail["differing"][0]
    # 1.05 rounded into the dtype: bfloat16 holds 1.046875
    assert len(detail["differing"]) == 1 and worst["ratio"] == pytest.approx(1.05, abs=4e-3), detail["differing"]


def test_quant_experts_name_layer1_whose_expert2_down_scale_is_5_percent_off(in_child: Any, tmp_path: Any) -> None:
    """The expert oracle (quant_experts) at TP 1 and 2: the planted Mixtral's linear layers and layer 0's experts
    are right, layer 1's expert 2 scales its down projection by 1.05; the items fail naming layer 1's experts."""
    from pytest_enginecheck.targets.vllm.checkpoints.quantized import METHODS
    from pytest_enginecheck.targets.vllm.checks.quant import scheme_dtype

    _needs_kernel("int8")
    if scheme_dtype(METHODS["int8"]) != "bfloat16":
        pytest.skip("vLLM's CPU backend runs int8 MoE experts only with AMX tiles (elsewhere the item skips)")
    results = in_child(_quant, str(tmp_path), "EctpQuantExpertForCausalLM", "int8", (1, 2), timeout=1200.0)
    for tp in (1, 2):
        assert isinstance(results[tp], tuple), results[tp]
        message, detail = results[tp]
        assert message.startswith("The int8 MoE experts model.layers.1.block_sparse_moe.experts.") and (
            f" of EctpQuantExpertForCausalLM at tensor_parallel_size={tp} (rank " in message), message
        assert detail["kind"] == "expert_mismatch" and detail["largest_local_error"] == 0.0, detail
        assert {d["name"].split(".")[2] for d in detail["differing"]} == {"1"}, detail["differing"]
        assert {d["rank"] for d in detail["differing"]} == set(range(tp)), detail["differing"]


@pytest.mark.parametrize("method", ["int8", "w4a16"])
def test_quant_tp2_names_the_rank_whose_gate_proj_scale_is_sharded_wrongly(in_child: Any, tmp_path: Any,
                                                                          method: str) -> None:
    _needs_kernel(method)
    results = in_child(_quant, str(tmp_path), "EctpQuantShardForCausalLM", method, (1, 2), timeout=1200.0)
    assert isinstance(results[1], dict) and results[1]["largest_local_error"] == 0.0, results[1]  # right at TP=1
    assert isinstance(results[2], tuple), results[2]
    message, detail = results[2]
    assert message.startswith(f"The {method} layer model.layers.1.mlp.gate_up_proj of EctpQuantShardForCausalLM at "
                              f"tensor_parallel_size=2 (rank 1, "), message
    assert {(d["name"], d["rank"]) for d in detail["differing"]} == {("model.layers.1.mlp.gate_up_proj", 1)}


def test_quant_on_llama_qwen2_and_mixtral(pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """One --enginecheck session: Llama and Qwen2 pass every method at TP 1 and 2, every quantized layer bitwise
    equal to deq(W)'s (Llama is also the planted models' clean twin: they subclass it); Mixtral's experts have no MoE
    kernel on vLLM's CPU backend for w4a16, nor for int8 without AMX, so those items skip with vLLM's reason (with AMX
    its int8 experts run and pass the expert oracle)."""
    from pytest_enginecheck.targets.vllm.checkpoints.quantized import METHODS
    from pytest_enginecheck.targets.vllm.checks.quant import scheme_dtype

    _needs_kernel("int8", "w4a16")
    monkeypatch.setenv("VLLM_PLUGINS", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--enginecheck", "--enginecheck-target=vllm", "--enginecheck-checks=quant",
        "--enginecheck-quant=int8,w4a16,fp8", "--enginecheck-timeout=600", f"--enginecheck-json={report}", "-rfs",
        "-k", "(LlamaForCausalLM or Qwen2ForCausalLM or MixtralForCausalLM) and not eagle",
        "--deselect", "enginecheck::LLaMAForCausalLM", timeout=RUN_TIMEOUT_S)  # -k ignores case: LLaMA is Llama
    by_item = {(r["arch"], r["check"]): r for r in json.loads(Path(report).read_text())["results"]}
    # the header's not-offered sentence, its lines wrapped to the terminal joined back
    header = " ".join(line.strip() for line in result.outlines if line.startswith(("enginecheck: ", "  ")))
    assert "enginecheck: not offered: quant[fp8] (vLLM" in header, header
    assert "quant[fbgemm_fp8]" not in header, header  # not asked for: named with -v only
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM"):
        for tp in (1, 2):
            assert (arch, f"quant[fp8,tp={tp}]") not in by_item  # refused here: no item, the header says why
            for method in ("int8", "w4a16"):
                item = by_item[arch, f"quant[{method},tp={tp}]"]
                if arch == "MixtralForCausalLM" and method == "int8" and scheme_dtype(METHODS[method]) == "bfloat16":
                    # vLLM 0.32 runs int8 experts on a CPU with AMX: the attention layers are exact, the experts
                    # within the expert oracle's derived bound
                    assert item["outcome"] == "passed", item
                    detail = item["detail"]
                    assert detail["largest_local_error"] == 0.0 and 0 < detail["largest_expert_error_share"] <= 1, item
                    assert len(detail["experts"]) == 2, item
                elif arch == "MixtralForCausalLM":
                    assert item["outcome"] == "skipped", item
                    assert "cannot run MixtralForCausalLM's MoE experts quantized" in item["message"], item
                    assert "MoE backend supports the deployment configuration" in item["message"], item
                else:
                    assert item["outcome"] == "passed", (item, result.stdout.str()[-3000:])
                    assert item["detail"]["largest_local_error"] == 0.0, item
                    assert len(item["detail"]["quantized_layers"]) == 8, item  # 2 layers x qkv, o, gate_up, down
