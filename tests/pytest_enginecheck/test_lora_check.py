"""``pytest --enginecheck`` with the lora check: ``lora[tp=1]`` / ``lora[tp=2]`` pass for the bundled architectures
that declare SupportsLoRA (at TP=1 held to transformers + PEFT with the same adapter), skip (saying why) for Llava,
and fail for a model whose layer tells LoRA the wrong input columns at TP=2 while its own weights load right, and
(lora[tp=1] only) for a model whose layer 1 never applies its down_proj adapter, beside its clean twin."""

from __future__ import annotations

import pytest

from tests.helpers import ARCHITECTURES as BUNDLED
from tests.zoo_sessions import LORA_BUNDLED, LORA_SHARD, ZooSession, zoo_session

# the fixtures that read a shared zoo session -> its name (started early: tests/zoo_sessions.py)
ZOO_SESSIONS = {"bundled_lora": "lora-bundled", "shard_lora": "lora-shard"}

LORA_ARCHITECTURES = ["LlamaForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3MoeForCausalLM"]
LORA_CHECKS = ["lora[tp=1]", "lora[tp=2]"]


@pytest.fixture(scope="module")
def bundled_lora(tmp_path_factory: pytest.TempPathFactory) -> ZooSession:
    """``pytest --enginecheck --enginecheck-checks=lora -v`` over the bundled zoo (shared, started early)."""
    return zoo_session(tmp_path_factory, "lora-bundled", *LORA_BUNDLED)


@pytest.fixture(scope="module")
def shard_lora(tmp_path_factory: pytest.TempPathFactory) -> ZooSession:
    """The load and lora checks over zoo.lora_models (shared, started early)."""
    return zoo_session(tmp_path_factory, "lora-shard", *LORA_SHARD)


def glob(text: str) -> str:
    """``text`` as an fnmatch pattern whose ``[`` are literal."""
    return text.replace("[", "[[]")


def test_lora_check_on_the_bundled_zoo(bundled_lora: ZooSession) -> None:
    result, results = bundled_lora.result, bundled_lora.results
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=len(LORA_ARCHITECTURES) * 2, skipped=2)
    assert sorted(results) == sorted((arch, check) for arch in BUNDLED for check in LORA_CHECKS)
    for arch in LORA_ARCHITECTURES:
        for tp in (1, 2):
            r = results[(arch, f"lora[tp={tp}]")]
            assert r["outcome"] == "passed", r["message"]
            detail = r["detail"]
            assert detail["tensor_parallel_size"] == tp and len(detail["lora_bytes_per_rank"]) == tp
            assert all(b > 0 for b in detail["lora_bytes_per_rank"])
            assert detail["outputs"] != detail["base_outputs"]
            if tp == 2:
                assert detail["outputs"] == detail["reference"]
            else:  # transformers' class of its own name + PEFT, far below the tolerance
                assert (detail["oracle"], detail["reference"]) == ("reference", f"transformers' {arch}")
                assert detail["max_lora_difference"] <= detail["logprob_tolerance"] / 10, detail
                assert detail["max_base_difference"] <= detail["logprob_tolerance"] / 10, detail
    for check in LORA_CHECKS:
        llava = results[("LlavaForConditionalGeneration", check)]
        assert llava["outcome"] == "skipped"
        assert llava["message"] == ("LlavaForConditionalGeneration does not declare SupportsLoRA, so the engine "
                                    "refuses enable_lora for it")
    result.stdout.fnmatch_lines([glob(line) for line in (
        "*= enginecheck summary =*",
        "architecture * lora[tp=1]  lora[tp=2]",
        "-----*",
        "LlamaForCausalLM * ok * ok*",
        "LlavaForConditionalGeneration * skip * skip*",
        "MixtralForCausalLM * ok * ok*",
        "Qwen2ForCausalLM * ok * ok*",
        "Qwen3MoeForCausalLM * ok * ok*",
        "5 architectures: 8 passed, 0 failed, 2 skipped",
    )])


def test_lora_check_catches_a_layer_that_misleads_lora(shard_lora: ZooSession) -> None:
    """load passes at TP=2 (the base weights shard right); lora[tp=2] fails: A is sliced by input_start. The model
    declares no reference and transformers has none of its name: lora[tp=1] is held to itself, and says so."""
    result, results = shard_lora.result, shard_lora.results
    arch = "LoRAShardLlamaForCausalLM"
    assert {check: r["outcome"] for (name, check), r in results.items() if name == arch} == {
        "load[tp=1]": "passed", "load[tp=2]": "passed", "lora[tp=1]": "passed", "lora[tp=2]": "failed"}
    tp1 = results[(arch, "lora[tp=1]")]["detail"]
    assert tp1["oracle"] == "self" and "max_lora_difference" not in tp1
    assert tp1["oracle_why"] == f"transformers has no class {arch} and its class declares no enginecheck_reference"
    failed = results[(arch, "lora[tp=2]")]
    assert failed["message"].startswith(f"At tensor_parallel_size=2, {arch} with a LoRA adapter generates different "
                                        f"tokens than at tensor_parallel_size=1 (prompt "), failed["message"]
    assert "Check the output_shard / input_start of the layers this model changed" in failed["message"]
    assert failed["detail"]["kind"] == "tp_mismatch" and failed["detail"]["outputs"] != failed["detail"]["reference"]
    result.stdout.fnmatch_lines([glob(line) for line in (
        "*= enginecheck summary =*",
        "architecture * load[tp=1]  load[tp=2]  lora[tp=1]  lora[tp=2]",
        "-----*",
        f"{arch} * ok * ok * ok * FAIL*",
        "3 architectures: 10 passed, 2 failed, 0 skipped",
    )])


def test_lora_check_catches_an_adapter_one_module_skips(shard_lora: ZooSession) -> None:
    """Layer 1 calls down_proj through a handle the engine's LoRA never wraps: every self-consistency comparison
    passes (the other adapters change the output, TP=2 skips it as TP=1 does, load has no adapter); lora[tp=1]'s
    transformers + PEFT oracle fails, naming the module and that its LoRA layer was never called. The twin (the same
    fused call through the wrapped attribute) passes everything, far below the tolerance."""
    results = shard_lora.results
    bug, twin = "LoRABypassLlamaForCausalLM", "LoRABypassTwinLlamaForCausalLM"
    assert {check: results[(bug, check)]["outcome"] for check in ("load[tp=1]", "load[tp=2]", *LORA_CHECKS)} == {
        "load[tp=1]": "passed", "load[tp=2]": "passed", "lora[tp=1]": "failed", "lora[tp=2]": "passed"}
    failed = results[(bug, "lora[tp=1]")]
    detail = failed["detail"]
    assert failed["message"].startswith(
        f"{bug} at tensor_parallel_size=1 with a LoRA adapter does not compute what transformers' LlamaForCausalLM "
        f"with PEFT's adapter computes on the same tiny checkpoint and adapter (float32), while without the adapter "
        f"they agree: "), failed["message"]
    assert ("is the LoRA target model.layers.1.mlp.down_proj (engine_ref's model.layers.1.mlp.down_proj, a "
            "RowParallelLinearWithLoRA): its LoRA layer was never called, only the base layer it wraps, so its "
            "adapter is silently skipped.") in failed["message"]
    assert (detail["kind"], detail["module"], detail["oracle"]) == \
        ("lora_mismatch", "model.layers.1.mlp.down_proj", "reference")
    assert detail["lora_layers_not_called"] == ["model.layers.1.mlp.down_proj"]
    assert detail["max_base_difference"] <= detail["logprob_tolerance"] / 10
    assert detail["difference"] > 1000 * detail["logprob_tolerance"]
    assert results[(bug, "lora[tp=2]")]["detail"]["outputs"] == results[(bug, "lora[tp=2]")]["detail"]["reference"]
    for check in ("load[tp=1]", "load[tp=2]", *LORA_CHECKS):
        assert results[(twin, check)]["outcome"] == "passed", results[(twin, check)]["message"]
    clean = results[(twin, "lora[tp=1]")]["detail"]
    assert (clean["oracle"], clean["reference"]) == ("reference", "transformers' LlamaForCausalLM")
    assert clean["max_lora_difference"] <= clean["logprob_tolerance"] / 10
