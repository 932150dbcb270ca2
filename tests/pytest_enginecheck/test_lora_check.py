"""``pytest --enginecheck`` with the lora check: ``lora[tp=1]`` / ``lora[tp=2]`` pass for the bundled architectures
that declare SupportsLoRA, skip (saying why) for Llava, and fail for a model whose layer tells LoRA the wrong
input columns at TP=2 while its own weights load right."""

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
    """load passes at TP=2 (the base weights shard right); lora[tp=2] fails: A is sliced by input_start."""
    result, results = shard_lora.result, shard_lora.results
    arch = "LoRAShardLlamaForCausalLM"
    assert {check: r["outcome"] for (_, check), r in results.items()} == {
        "load[tp=1]": "passed", "load[tp=2]": "passed", "lora[tp=1]": "passed", "lora[tp=2]": "failed"}
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
        "1 architecture: 3 passed, 1 failed, 0 skipped",
    )])
