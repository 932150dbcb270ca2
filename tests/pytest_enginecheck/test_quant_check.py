"""``pytest --enginecheck`` runs ``quant[METHOD,tp=N]``: it passes a correct model for every method, fails a
scale 5 % off in one weight of layer 1 (zoo.planted_quant), a scale sharded wrongly and a layer computing with
its raw 8-bit weight (against the dequantized-weight oracle, naming the weight or saying none differs), skips
an architecture without SupportsQuant, and its items are columns of the summary table. One subprocess run,
shared by the tests, read item by item from its JSON report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ZOO = Path(__file__).parents[1] / "plugin_zoo"

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
REGISTRY.register_model("CleanTwinLlamaForCausalLM", "zoo.planted_clean:CleanTwinLlamaForCausalLM")
REGISTRY.register_model("QuantScaleLlamaForCausalLM", "zoo.planted_quant:QuantScaleLlamaForCausalLM")
REGISTRY.register_model("LlavaForConditionalGeneration",
                        "engine_ref.model_executor.models.llava:LlavaForConditionalGeneration")
REGISTRY.register_model("RankZeroScaleLlamaForCausalLM", "quant_zoo:RankZeroScaleLlamaForCausalLM")
REGISTRY.register_model("RawWeightLlamaForCausalLM", "quant_zoo:RawWeightLlamaForCausalLM")
'''


METHODS = ("int8", "fp8")  # fbgemm_fp8 (per-channel fp8) is int8's layout in fp8: engine_ref tests it
ITEMS = tuple(f"quant[{m},tp={tp}]" for m in METHODS for tp in (1, 2))
ARCHS = ("CleanTwinLlamaForCausalLM", "LlavaForConditionalGeneration", "QuantScaleLlamaForCausalLM",
         "RankZeroScaleLlamaForCausalLM", "RawWeightLlamaForCausalLM")


@pytest.fixture(scope="module")
def quant_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[tuple[str, str], dict[str, Any]]]:
    """``pytest --enginecheck --enginecheck-checks=quant --enginecheck-quant=int8,fp8`` over the quant
    zoo, in a subprocess: (its stdout, its results by (architecture, item))."""
    run_dir = tmp_path_factory.mktemp("quant-zoo")
    (run_dir / "quant_zoo.py").write_text(QUANT_ZOO)
    report = run_dir / "report.json"
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--enginecheck",
                          "--enginecheck-target=quant_zoo:REGISTRY", "--enginecheck-checks=quant",
                          f"--enginecheck-quant={','.join(METHODS)}", "--enginecheck-tp=1,2",
                          f"--enginecheck-json={report}"],
                         cwd=run_dir, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "ENGINE_REF_PLUGINS": "", "PYTHONPATH": f"{run_dir}{os.pathsep}{ZOO}"})
    assert report.exists(), out.stdout + out.stderr
    return out.stdout, {(r["arch"], r["check"]): r for r in json.loads(report.read_text())["results"]}


def test_a_correct_model_passes(quant_run: tuple[str, dict[tuple[str, str], dict[str, Any]]]) -> None:
    """Exact bytes (estimate == measurement, checked by the item), the oracle met exactly, the loose bound held."""
    _, results = quant_run
    assert set(results) == {(arch, item) for arch in ARCHS for item in ITEMS}
    for item in ITEMS:
        r = results["CleanTwinLlamaForCausalLM", item]
        assert r["outcome"] == "passed", r["message"]
        d = r["detail"]
        tp = d["tensor_parallel_size"]
        assert (d["quantization"], tp) == (item[6:item.index(",")], int(item[-2]))
        quantized = {engine: v for engine, v in d["oracle_difference"].items() if not engine.startswith("dequantized")}
        assert quantized == {"converted_tp1": 0.0, f"prequantized_tp{tp}": 0.0}, d["oracle_difference"]
        # the TP=N oracle against TP=1: only the summation order differs, far inside the tolerance
        assert d["oracle_difference"].get(f"dequantized_tp{tp}", 0.0) < d["oracle_tolerance"] / 100
        assert 0 < max(d["logits_error"].values()) <= d["tolerance"] < 1
        assert len(d["weight_bytes_per_rank"]) == tp and d["bytes_read_per_rank"] == d["weight_bytes_per_rank"]
        assert sum(d["weight_bytes_per_rank"]) < d["unquantized_weight_bytes"] / 2
    for item in ITEMS:
        r = results["LlavaForConditionalGeneration", item]
        assert r["outcome"] == "skipped" and "does not declare SupportsQuant" in r["message"], r


def test_a_scale_5_percent_off_in_one_weight_fails(quant_run: tuple[str, dict[tuple[str, str], dict[str, Any]]]
                                                   ) -> None:
    """Layer 1's down_proj scale 1.05x after loading (which the loose bound alone passed): far outside the oracle's
    tolerance (a 1 % error would be too: the effect is linear, 1/5 of this), named down to the weight."""
    _, results = quant_run
    for item in ITEMS:
        r = results["QuantScaleLlamaForCausalLM", item]
        assert (r["outcome"], r["detail"]["kind"]) == ("failed", "oracle_mismatch"), r
        d = r["detail"]
        assert d["oracle_difference"]["converted_tp1"] / 5 > 10 * d["oracle_tolerance"]
        assert d["weight_differences"][0]["name"] == "model.layers.1.mlp.down_proj.weight"
        assert abs(d["weight_differences"][0]["ratio"] - 1.05) < 1e-3 and len(d["weight_differences"]) == 1
        assert "(converted_tp1) are not those of the unquantized engine loaded with the dequantized weights" in \
            r["message"] and "differs from deq(W) in model.layers.1.mlp.down_proj.weight (rank 0" in r["message"]


def test_a_scale_sharded_wrongly_fails_at_tp2(quant_run: tuple[str, dict[tuple[str, str], dict[str, Any]]]) -> None:
    """A per-channel scale read from rank 0's rows on every rank: right at TP=1, wrong on rank 1 at TP=2 (int8;
    fp8's per-tensor scale has no rows to get wrong)."""
    _, results = quant_run
    for method in METHODS:
        assert results["RankZeroScaleLlamaForCausalLM", f"quant[{method},tp=1]"]["outcome"] == "passed"
        r = results["RankZeroScaleLlamaForCausalLM", f"quant[{method},tp=2]"]
        if method == "fp8":
            assert r["outcome"] == "passed", r["message"]
            continue
        assert (r["outcome"], r["detail"]["kind"]) == ("failed", "oracle_mismatch"), r
        assert {(w["name"], w["rank"]) for w in r["detail"]["weight_differences"]} == {
            (f"model.layers.{i}.mlp.gate_up_proj.weight", 1) for i in (0, 1)}
        assert "(prequantized_tp2)" in r["message"] and "weight_scale is loaded, sharded" in r["message"]


def test_a_layer_bypassing_its_quant_method_fails(quant_run: tuple[str, dict[tuple[str, str], dict[str, Any]]]
                                                  ) -> None:
    """gate_up_proj's raw 8-bit weight used without its scale: every dequantized weight is right, the logits not."""
    _, results = quant_run
    for item in ITEMS:
        r = results["RawWeightLlamaForCausalLM", item]
        assert (r["outcome"], r["detail"]["kind"]) == ("failed", "oracle_mismatch"), r
        assert r["detail"]["weight_differences"] == []
        assert "Every weight the quant methods dequantize equals deq(W) on every rank" in r["message"]


def test_the_items_are_columns_of_the_summary_table(quant_run: tuple[str, dict[tuple[str, str], dict[str, Any]]]
                                                    ) -> None:
    stdout, _ = quant_run
    columns = sorted(ITEMS)  # the table's order: quant[fp8,...] before quant[int8,...]
    pytest.LineMatcher(stdout.splitlines()).fnmatch_lines([
        "*= enginecheck summary =*",
        "architecture * " + "  ".join(c.replace("[", "[[]") for c in columns),
        "-----*",
        "CleanTwinLlamaForCausalLM" + " * ok" * 4 + "*",
        "LlavaForConditionalGeneration" + " * skip" * 4 + "*",
        "QuantScaleLlamaForCausalLM" + " * FAIL" * 4 + "*",
        "RankZeroScaleLlamaForCausalLM * ok * ok * ok * FAIL*",
        "RawWeightLlamaForCausalLM" + " * FAIL" * 4 + "*",
        "5 architectures: 7 passed, 9 failed, 4 skipped",
    ])


def test_unknown_method_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", "--enginecheck-quant=fp8,awq")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--enginecheck-quant='fp8,awq': unknown method(s) awq; "
                                 "choose from fp8,fbgemm_fp8,int8*"])
