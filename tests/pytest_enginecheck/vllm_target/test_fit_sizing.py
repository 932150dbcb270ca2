"""The fit prediction's pure arithmetic (no vLLM): the GPU-only terms' stated estimates and ranges, and vLLM's
``determine_available_memory`` on them."""

from __future__ import annotations

import pytest

from pytest_enginecheck.targets.vllm.fit.estimates import (
    CUDA_GRAPHS,
    FORMULA,
    MEASURED,
    MEASURED_RANGE,
    Estimate,
    GiB,
    ProfileShapes,
    activation_peak,
    cuda_graphs,
    measured_activation_peak,
    non_torch,
)
from pytest_enginecheck.targets.vllm.fit.sizing import GpuTerms, available_kv_cache_memory, requested_memory

# Llama-3.1-70B at TP=4 in bfloat16: hidden 8192; the largest layer per rank is gate_up_proj (2 x 28672 / 4 = 14336
# outputs) with its activation (7168): 21504 values per token; a vocabulary of 128256.
LLAMA_70B_TP4 = ProfileShapes(hidden_bytes_per_token=8192 * 2, layer_bytes_per_token=21504 * 2, vocab_size=128256,
                              dtype_size=2)


def test_the_activation_peak_is_the_larger_of_the_dummy_forward_and_the_sampler_run_with_its_range() -> None:
    peak = activation_peak(LLAMA_70B_TP4, max_num_batched_tokens=8192, max_num_seqs=1024)
    forward = 8192 * (2 * 8192 + 21504) * 2  # 0.58 GiB
    sampler = 1024 * 128256 * (2 + 4 + 4 + 8) + 8192 * 8192 * 2  # 2.33 GiB: the logits dominate at 1024 rows
    assert peak.estimate == max(forward, sampler) == sampler
    assert (peak.low, peak.high) == (sampler // 2, 2 * sampler)
    assert "dummy sampler run" in peak.basis
    fewer_rows = activation_peak(LLAMA_70B_TP4, max_num_batched_tokens=8192, max_num_seqs=16)
    assert fewer_rows.estimate == forward and "dummy forward" in fewer_rows.basis


def test_a_measured_peak_is_the_estimate_with_the_stated_cuda_range_and_says_so() -> None:
    peak = measured_activation_peak(3_303_055_360, max_num_batched_tokens=8192, max_num_seqs=1024)
    low, middle, high = MEASURED_RANGE
    assert (peak.low, peak.estimate, peak.high) == (int(3_303_055_360 * low), int(3_303_055_360 * middle),
                                                    int(3_303_055_360 * high))
    assert "3.08 GiB, x0.75 (x0.5 to x1.6)" in peak.basis
    assert peak.low < peak.estimate < peak.high
    assert peak.basis.startswith(MEASURED) and "max_num_batched_tokens=8192" in peak.basis and "1024 rows" in peak.basis
    assert GpuTerms(peak, non_torch(4), cuda_graphs(True)).activation_peak_source == MEASURED


def test_the_formula_stands_in_labelled_with_why_the_fake_run_failed() -> None:
    peak = activation_peak(LLAMA_70B_TP4, 8192, 1024,
                           unmeasured="the fake run failed: UnsupportedOperatorException: _C.some_op")
    assert peak.basis.startswith(f"{FORMULA} (the fake run failed: UnsupportedOperatorException: _C.some_op)")
    assert GpuTerms(peak, non_torch(4), cuda_graphs(True)).activation_peak_source == FORMULA
    assert activation_peak(LLAMA_70B_TP4, 8192, 1024).basis.startswith(f"{FORMULA}: ")


def test_the_constant_terms_depend_on_tp_and_enforce_eager_only() -> None:
    assert non_torch(1).estimate < non_torch(2).estimate == non_torch(8).estimate
    assert cuda_graphs(enforce_eager=True) == Estimate.exact(0, "enforce_eager: no CUDA graphs")
    graphs = cuda_graphs(enforce_eager=False)
    assert (graphs.low, graphs.estimate, graphs.high) == CUDA_GRAPHS
    for term in (non_torch(1), non_torch(4), graphs):
        assert 0 < term.low < term.estimate < term.high
    # a vLLM that does not subtract its graphs (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0, before 0.21)
    assert cuda_graphs(enforce_eager=False, estimated=False).estimate == 0


def test_requested_memory_is_vllms_ceiling_of_total_times_utilization() -> None:
    assert requested_memory(80 * GiB, 0.9) == 77309411328  # ceil(85899345920 x 0.9)
    assert requested_memory(10, 0.33) == 4  # 3.3 rounded up, as math.ceil in vLLM's request_memory


def test_available_kv_memory_takes_every_term_at_its_high_for_its_low() -> None:
    terms = GpuTerms(Estimate(1, 2, 4), Estimate(10, 20, 40), Estimate(100, 200, 400))
    available = available_kv_cache_memory(1000, 1.0, 300, terms)
    assert (available.low, available.estimate, available.high) == (1000 - 300 - 444, 1000 - 300 - 222,
                                                                   1000 - 300 - 111)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_the_range_of_available_memory_is_ordered(enforce_eager: bool) -> None:
    terms = GpuTerms(activation_peak(LLAMA_70B_TP4, 8192, 1024), non_torch(4), cuda_graphs(enforce_eager))
    available = available_kv_cache_memory(80 * GiB, 0.9, 35_312_387_328, terms)
    assert available.low < available.estimate < available.high < requested_memory(80 * GiB, 0.9) - 35_312_387_328
