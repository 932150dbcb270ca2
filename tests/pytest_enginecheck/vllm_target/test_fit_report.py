"""The fit prediction's report (no vLLM): exact figures print as numbers, the figures that rest on a GPU-only term as
their stated estimate and range; identical ranks print once; the verdict, the smallest TP size and the JSON."""

from __future__ import annotations

import json
from dataclasses import replace

from pytest_enginecheck.targets.vllm.fit.estimates import Estimate, GiB, measured_activation_peak
from pytest_enginecheck.targets.vllm.fit.report import FitReport, RankFit, render, verdict
from pytest_enginecheck.targets.vllm.fit.sizing import GpuTerms

TERMS = GpuTerms(Estimate(GiB, 2 * GiB, 4 * GiB, "formula"), Estimate(GiB // 4, GiB // 2, GiB, "constant"),
                 Estimate.exact(0, "enforce_eager: no CUDA graphs"))


def _rank(rank: int, weights: int = 35_278_831_616) -> RankFit:
    tokens = Estimate(405_776, 469_040, 493_472, "range")
    return RankFit(rank=rank, weights_bytes=weights, buffers_bytes=33_555_712, kv_bytes_per_token=81_920,
                   kv_one_request_bytes=32_768 * 81_920, kv_layers=80,
                   kv_spec="80 x FullAttentionSpec(num_kv_heads=2, head_size=128, bfloat16)", terms=TERMS,
                   available_kv_cache_memory=Estimate(31 * GiB, 35 * GiB, 37 * GiB, "formula"),
                   num_blocks=Estimate(25_361, 29_315, 30_842, "range"),
                   kv_cache_bytes=Estimate(31 * GiB, 35 * GiB, 37 * GiB, "range"), kv_tokens=tokens,
                   max_concurrency_x100=Estimate(1238, 1431, 1505, "range"),
                   max_model_len_that_fits=Estimate.exact(131_072, "bounded"))


def _report(ranks: list[RankFit], fits: Estimate, sizes: dict[int, Estimate] | None = None) -> FitReport:
    return FitReport(config="Meta-Llama-3.1-70B.json", architecture="LlamaForCausalLM", tensor_parallel_size=len(ranks),
                     gpu_memory=80 * GiB, gpu_memory_utilization=0.9, max_model_len=32_768,
                     derived_max_model_len=131_072, dtype="bfloat16", kv_cache_dtype="auto", block_size=16,
                     max_num_batched_tokens=8192, max_num_seqs=1024, enforce_eager=True, ranks=ranks,
                     max_model_len_that_fits=fits, seconds=1.5, sizes=sizes or {})


def test_the_verdict_says_fits_only_when_the_worst_case_fits() -> None:
    assert verdict(Estimate(32_768, 40_000, 50_000), 32_768) == "fits"
    assert verdict(Estimate(20_000, 40_000, 50_000), 32_768) == "may not fit"
    assert verdict(Estimate(10_000, 20_000, 32_767), 32_768) == "does not fit"


def test_identical_ranks_print_once_exact_figures_plainly_and_estimates_as_ranges() -> None:
    text = render(_report([_rank(r) for r in range(4)], Estimate.exact(131_072)))
    assert "[rank 0-3] Model loading took 32.89 GiB memory (exact: 35,278,831,616 B of parameters + 33,555,712 B" in (
        text)
    assert "[rank 1" not in text
    assert "81,920 B per token (exact)" in text
    assert "[rank 0-3] Available KV cache memory: ~35.00 GiB (range 31.00 to 37.00 GiB)" in text
    assert "GPU KV cache size: ~469,040 tokens (range 405,776 to 493,472)" in text
    assert "Maximum concurrency for 32,768 tokens per request: ~14.31x (range 12.38x to 15.05x)" in text
    assert "CUDA graphs 0.00 GiB," not in text and "CUDA graphs 0.00 GiB" in text  # exact: no range
    assert "activation peak ~2.00 GiB (range 1.00 to 4.00 GiB) (formula estimate), non-torch" in text
    assert "Largest max_model_len that fits: 131,072 tokens (the model's maximum is 131,072)" in text
    assert "max_model_len=32,768 fits, also with every GPU-only term at the high end of its range" in text


def test_a_measured_activation_peak_says_so() -> None:
    measured = replace(TERMS, activation_peak=measured_activation_peak(2 * GiB, 8192, 1024))
    text = render(_report([replace(_rank(0), terms=measured)], Estimate.exact(131_072)))
    assert "activation peak ~1.50 GiB (range 1.00 to 3.20 GiB) (measured on fake tensors), non-torch" in text


def test_ranks_that_differ_print_apart() -> None:
    text = render(_report([_rank(0), _rank(1, weights=1)], Estimate.exact(131_072)))
    assert "[rank 0] Model loading" in text and "[rank 1] Model loading" in text


def test_the_smallest_tp_size_at_the_estimate_and_in_the_worst_case() -> None:
    sizes = {1: Estimate(0, 0, 0), 2: Estimate(10_000, 40_000, 60_000), 4: Estimate.exact(131_072),
             8: Estimate.exact(131_072)}
    report = _report([_rank(r) for r in range(4)], Estimate.exact(131_072), sizes)
    assert (report.smallest_tp(worst_case=False), report.smallest_tp(worst_case=True)) == (2, 4)
    assert "Smallest tensor_parallel_size that fits (tried 1, 2, 4, 8): 2 at the estimate, 4 in the worst case" in (
        render(report))
    nothing = replace(report, sizes={1: Estimate(0, 0, 0)})
    assert nothing.smallest_tp(worst_case=False) is None
    assert "none at the estimate, none in the worst case" in render(nothing)


def test_the_json_has_a_list_of_ranks_and_the_runs_max_model_len_that_fits() -> None:
    data = json.loads(json.dumps(_report([_rank(0), _rank(1)], Estimate(20_000, 40_000, 60_000)).to_dict()))
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    rank = data["ranks"][0]
    assert (rank["weights_bytes"], rank["kv_bytes_per_token"]) == (35_278_831_616, 81_920)
    assert rank["kv_cache_bytes"] == {"low": 31 * GiB, "estimate": 35 * GiB, "high": 37 * GiB, "basis": "range"}
    assert rank["kv_tokens"]["estimate"] == 469_040
    assert data["max_model_len_that_fits"]["low"] == 20_000 and data["verdict"] == "may not fit"
