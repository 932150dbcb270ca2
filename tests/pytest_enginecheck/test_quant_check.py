"""``pytest --enginecheck`` runs ``quant[METHOD,tp=N]``: it passes a correct model for every method, fails a
scale 5 % off in one weight of layer 1 (zoo.planted_quant), a scale sharded wrongly and a layer computing with
its raw 8-bit weight (zoo.quant_bugs; against the dequantized-weight oracle, naming the weight or saying none
differs), skips an architecture without SupportsQuant, and its items are in the summary table. One
session, shared by the tests, read item by item from its JSON report.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.zoo_sessions import QUANT, zoo_session

# the fixture that reads a shared zoo session -> its name (started early: tests/zoo_sessions.py)
ZOO_SESSIONS = {"quant_run": "quant"}
METHODS = ("int8", "fp8")  # fbgemm_fp8 (per-channel fp8) is int8's layout in fp8: engine_ref tests it
assert QUANT[2] == f"--enginecheck-quant={','.join(METHODS)}"
ITEMS = tuple(f"quant[{m},tp={tp}]" for m in METHODS for tp in (1, 2))
ARCHS = ("CleanTwinLlamaForCausalLM", "LlavaForConditionalGeneration", "QuantScaleLlamaForCausalLM",
         "RankZeroScaleLlamaForCausalLM", "RawWeightLlamaForCausalLM")


@pytest.fixture(scope="module")
def quant_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[tuple[str, str], dict[str, Any]]]:
    """``pytest --enginecheck --enginecheck-checks=quant --enginecheck-quant=int8,fp8`` over zoo.quant_bugs (a
    shared zoo session, started in the background): (its stdout, its results by (architecture, item))."""
    session = zoo_session(tmp_path_factory, "quant", *QUANT)
    return session.stdout, session.results


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
    """A column per item where the terminal is wide enough for one (99 columns), else a mark per item in the quant
    column, in the same order."""
    stdout, _ = quant_run
    columns = sorted(ITEMS)  # the table's order: quant[fp8,...] before quant[int8,...]
    width = len(next(line for line in stdout.splitlines() if " enginecheck summary " in line))
    if width >= 99:
        header, cells = "architecture * " + "  ".join(c.replace("[", "[[]") for c in columns), {
            "ok": "ok", "FAIL": "FAIL", "skip": "skip"}
    else:
        header, cells = "architecture * quant", {"ok": ".", "FAIL": "F", "skip": "s"}

    def row(arch: str, *outcomes: str) -> str:
        joined = " * ".join(cells[o] for o in outcomes) if width >= 99 else "".join(cells[o] for o in outcomes)
        return f"{arch} * {joined}*"

    pytest.LineMatcher(stdout.splitlines()).fnmatch_lines([
        "*= enginecheck summary =*",
        header,
        "-----*",
        row("CleanTwinLlamaForCausalLM", *["ok"] * 4),
        row("LlavaForConditionalGeneration", *["skip"] * 4),
        row("QuantScaleLlamaForCausalLM", *["FAIL"] * 4),
        row("RankZeroScaleLlamaForCausalLM", "ok", "ok", "ok", "FAIL"),
        row("RawWeightLlamaForCausalLM", *["FAIL"] * 4),
        "5 architectures: 7 passed, 9 failed, 4 skipped",
    ])


def test_unknown_method_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", "--enginecheck-quant=fp8,awq")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--enginecheck-quant='fp8,awq': unknown method(s) awq; "
                                 "choose from fp8,fbgemm_fp8,int8*"])
