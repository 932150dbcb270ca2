"""``pytest --enginecheck`` runs ``quant[METHOD,tp=N]``: it passes a correct model, fails a scale sharded wrongly
and a layer computing with its raw 8-bit weight, skips an architecture without SupportsQuant, and its items
are columns of the summary table. One subprocess run, read item by item from its JSON report.
"""

from __future__ import annotations

import json

import pytest

QUANT_ZOO = '''
"""Quantization bugs a model author can make, in a registry of their own."""

import torch.nn.functional as F

from engine_ref.model_executor.layers.linear import MergedColumnParallelLinear, _load_rows
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine_ref.model_executor.model_loader.weight_utils import check_shape
from engine_ref.model_executor.models.registry import _ModelRegistry


class RankZeroScaleLinear(MergedColumnParallelLinear):
    """The bug: a per-channel weight_scale ([rows, 1]) is read from rank 0's rows on every rank."""

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 2 and param.shape[1] == 1:
            check_shape(loaded.name, loaded, param.checkpoint_shapes[shard_id])
            offset, size, _ = self.output_shard(shard_id)
            _load_rows(param, loaded, 0, offset, size, 0)
        else:
            super().weight_loader(param, loaded, shard_id)


class RankZeroScaleMLP(LlamaMLP):
    def __init__(self, hidden_size, intermediate_size, hidden_act="silu", bias=False, quant_config=None, prefix=""):
        super().__init__(hidden_size, intermediate_size, hidden_act, bias, quant_config, prefix)
        self.gate_up_proj = RankZeroScaleLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")


class RankZeroScaleDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_idx):
        return RankZeroScaleMLP(config.hidden_size, config.intermediate_size, quant_config=self.quant_config,
                                prefix=f"{self.prefix}.mlp")


class RankZeroScaleLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = RankZeroScaleDecoderLayer


class RawWeightMLP(LlamaMLP):
    """The bug: gate_up_proj's weight is used directly, bypassing its quant method (and so its scale)."""

    def forward(self, x):
        return self.down_proj(self.act_fn(F.linear(x, self.gate_up_proj.weight.to(x.dtype))))


class RawWeightDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_idx):
        return RawWeightMLP(config.hidden_size, config.intermediate_size, quant_config=self.quant_config,
                            prefix=f"{self.prefix}.mlp")


class RawWeightLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = RawWeightDecoderLayer


REGISTRY = _ModelRegistry({})
REGISTRY.register_model("LlamaForCausalLM", "engine_ref.model_executor.models.llama:LlamaForCausalLM")
REGISTRY.register_model("LlavaForConditionalGeneration",
                        "engine_ref.model_executor.models.llava:LlavaForConditionalGeneration")
REGISTRY.register_model("RankZeroScaleLlamaForCausalLM", "quant_zoo:RankZeroScaleLlamaForCausalLM")
REGISTRY.register_model("RawWeightLlamaForCausalLM", "quant_zoo:RawWeightLlamaForCausalLM")
'''


ITEMS = ("quant[int8,tp=1]", "quant[int8,tp=2]")
ARCHS = ("LlamaForCausalLM", "LlavaForConditionalGeneration", "RankZeroScaleLlamaForCausalLM",
         "RawWeightLlamaForCausalLM")


def test_quant_check_over_the_quant_zoo(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pytest --enginecheck --enginecheck-checks=quant --enginecheck-quant=int8`` over the quant zoo."""
    monkeypatch.setenv("ENGINE_REF_PLUGINS", "")
    pytester.makepyfile(quant_zoo=QUANT_ZOO)
    pytester.makeini("[pytest]\npythonpath = .\n")
    path = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--enginecheck", "--enginecheck-target=quant_zoo:REGISTRY",
        "--enginecheck-checks=quant", "--enginecheck-quant=int8", "--enginecheck-tp=1,2",
        f"--enginecheck-json={path}", timeout=600)
    assert path.exists(), result.stdout.str() + result.stderr.str()
    results = {(r["arch"], r["check"]): r for r in json.loads(path.read_text())["results"]}
    assert set(results) == {(arch, item) for arch in ARCHS for item in ITEMS}

    # A correct model: exact bytes (estimate == measurement, checked by the item), the stated tolerance held.
    for item in ITEMS:
        r = results["LlamaForCausalLM", item]
        assert r["outcome"] == "passed", r["message"]
        d = r["detail"]
        tp = d["tensor_parallel_size"]
        assert (d["quantization"], tp) == ("int8", int(item[-2]))
        assert 0 < max(d["logits_error"].values()) <= d["tolerance"] < 1
        assert len(d["weight_bytes_per_rank"]) == tp and d["bytes_read_per_rank"] == d["weight_bytes_per_rank"]
        assert sum(d["weight_bytes_per_rank"]) < d["unquantized_weight_bytes"] / 2

    # A per-channel scale read from rank 0's rows: right at TP=1, wrong at TP=2.
    assert results["RankZeroScaleLlamaForCausalLM", "quant[int8,tp=1]"]["outcome"] == "passed"
    r = results["RankZeroScaleLlamaForCausalLM", "quant[int8,tp=2]"]
    assert (r["outcome"], r["detail"]["kind"]) == ("failed", "tp_mismatch"), r
    assert "weight_scale is loaded into the wrong shard" in r["message"]

    # gate_up_proj's raw 8-bit weight used without its scale: the logits leave the tolerance at every TP size.
    for item in ITEMS:
        r = results["RawWeightLlamaForCausalLM", item]
        assert (r["outcome"], r["detail"]["kind"]) == ("failed", "quant_error"), r
        assert max(r["detail"]["logits_error"].values()) > r["detail"]["tolerance"]
        assert "more than the" in r["message"] and "a scale is wrong or misapplied" in r["message"]

    for item in ITEMS:
        r = results["LlavaForConditionalGeneration", item]
        assert r["outcome"] == "skipped" and "does not declare SupportsQuant" in r["message"], r

    result.assert_outcomes(passed=3, failed=3, skipped=2)
    result.stdout.fnmatch_lines([
        "*enginecheck summary*",
        "architecture * quant[[]int8,tp=1[]]  quant[[]int8,tp=2[]]",
        "LlamaForCausalLM * ok * ok*",
        "LlavaForConditionalGeneration * skip * skip*",
        "RankZeroScaleLlamaForCausalLM * ok * FAIL*",
        "RawWeightLlamaForCausalLM * FAIL * FAIL*",
    ])


def test_unknown_method_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", "--enginecheck-quant=fp8,awq")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--enginecheck-quant='fp8,awq': unknown method(s) awq; "
                                 "choose from fp8,fbgemm_fp8,int8*"])
