"""The terms of vLLM's sizing that only a GPU measures, as stated estimates with the range each implies.

vLLM's ``determine_available_memory`` subtracts from ``total x gpu_memory_utilization`` the weights (exact here: the
meta build), the torch activation peak of a profile run at ``max_num_batched_tokens`` (``torch_peak_increase``), the
memory of non-torch allocations since the worker started (``non_torch_increase``: NCCL, cuBLAS workspaces, the
custom all-reduce buffers) and, by default since vLLM 0.21 (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1``), the
memory of its CUDA graphs. None of the last three can be measured without the GPU, so each is an ``Estimate``: a
stated value and the range [low, high] it stands for. Every printed figure derived from them is a range.

The activation peak is measured where it can be (``measured_activation_peak``): vLLM's own profile run on the rank's
full-size model on fake tensors (``profile_run.py``), the torch allocator's exact bytes with the CPU platform's ops;
``MEASURED_RANGE`` scales it to what published GPU runs measured (CUDA's kernels keep other intermediates). Where
the fake run fails, a formula stands in (``activation_peak``, labelled "formula estimate"): from the rank's own layer
shapes (``ProfileShapes``, read off the meta build), the largest set of tensors that must coexist in one layer of the
dummy forward at ``max_num_batched_tokens`` tokens, or in the dummy sampler run over ``max_num_seqs`` rows of logits,
whichever is larger; its range is half to twice that (kernel scratch, attention workspaces and allocator rounding are
not counted, a fused kernel keeps less). The other two are constants (``NON_TORCH``, ``CUDA_GRAPHS``) from vLLM's
published startup logs (``docs/fit.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20
# vLLM's sampler turns the logits into float32 and sorts them for top-k/top-p: per logit, the model dtype's copy, the
# float32 logits, the sorted float32 values and their int64 indices.
SAMPLER_BYTES_PER_LOGIT_BEYOND_DTYPE = 4 + 4 + 8


@dataclass(frozen=True)
class Estimate:
    """A memory term (or a figure derived from one) that only a GPU measures: ``estimate`` and the range
    [``low``, ``high``] it stands for, in bytes or tokens; ``basis`` says where the numbers come from."""

    low: int
    estimate: int
    high: int
    basis: str = ""

    @classmethod
    def exact(cls, value: int, basis: str = "exact") -> Estimate:
        """A term with no uncertainty (a range of one value)."""
        return cls(value, value, value, basis)

    def to_dict(self) -> dict[str, int | str]:
        return {"low": self.low, "estimate": self.estimate, "high": self.high, "basis": self.basis}


@dataclass(frozen=True)
class ProfileShapes:
    """What one rank's profile run allocates, read off its meta-built model: per token of the dummy forward, the
    residual stream and the largest layer's intermediates (bytes), and per row of the dummy sampler run the logits
    (the vocabulary, gathered from every rank)."""

    hidden_bytes_per_token: int  # hidden_size x the dtype's size: the residual and the hidden states
    layer_bytes_per_token: int  # the largest layer's outputs that coexist (gate_up and its activation; MoE: x topk)
    vocab_size: int
    dtype_size: int


# Non-torch memory one rank gains from the worker's start to the end of the profile run (vLLM's non_torch_increase):
# cuBLAS and NCCL workspaces at TP=1, plus NCCL's and custom all-reduce's buffers at TP>1. Published logs: 0.24 to
# 0.27 GiB at TP=1 and 2.06 to 2.13 GiB at TP 2 and 4 on H100s (llm-d-planner's vLLM 0.19 runs), 0.25 GiB at TP=2
# on RTX 4090s without P2P (vllm-project/vllm#13061); docs/fit.md lists them.
NON_TORCH = {1: (int(0.1 * GiB), int(0.25 * GiB), int(0.6 * GiB)),
             2: (int(0.2 * GiB), int(2.07 * GiB), int(2.5 * GiB))}  # key 2: any TP > 1
# vLLM's CUDA-graph memory estimate (profile_cudagraph_memory), subtracted by default since vLLM 0.21: it grows with
# the number of capture sizes (up to 512 by default) and layers; 0 with --enforce-eager. Published: 0.61 to 1.69 GiB
# estimated, 0.51 to 1.85 GiB captured (llm-d-planner's vLLM 0.19 runs on H100s).
CUDA_GRAPHS = (int(0.3 * GiB), int(0.9 * GiB), int(2 * GiB))
ESTIMATE_CUDA_GRAPHS = "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"  # vLLM's switch for subtracting it


# How a peak measured on fake tensors (the CPU platform's ops, exact storage bytes) compares with the torch peak
# vLLM measures on CUDA, as factors of it: (low, estimate, high). Published H100 runs (llm-d-planner's vLLM 0.19,
# docs/fit.md) give 0.62 and 0.63 for dense models, whose peak is the dummy sampler run (the CPU's top-k/top-p keeps
# more copies of the logits than CUDA's), 0.76 and 0.81 for MoE and MLA models, and 1.51 for Mixtral at TP=2 (CUDA's
# fused-MoE intermediate caches, which the CPU's expert kernel does not keep); the estimate is their middle, the range
# holds them all.
MEASURED_RANGE = (0.5, 0.75, 1.6)
MEASURED = "measured on fake tensors"
FORMULA = "formula estimate"


def measured_activation_peak(peak: int, max_num_batched_tokens: int, max_num_seqs: int) -> Estimate:
    """The profile run's torch activation peak on one rank as measured on fake tensors (``profile_run.measure``),
    with the range MEASURED_RANGE gives it on CUDA."""
    low, middle, high = MEASURED_RANGE
    rows = min(max_num_seqs, max_num_batched_tokens)
    return Estimate(int(peak * low), int(peak * middle), int(peak * high),
                    f"{MEASURED}: vLLM's profile run (dummy forward at max_num_batched_tokens="
                    f"{max_num_batched_tokens}, dummy sampler run over {rows} rows) with the CPU platform's ops, "
                    f"{peak / GiB:.2f} GiB, x{middle:g} (x{low:g} to x{high:g}) for CUDA's kernels as published GPU "
                    f"runs measured them")


def activation_peak(shapes: ProfileShapes, max_num_batched_tokens: int, max_num_seqs: int,
                    unmeasured: str = "") -> Estimate:
    """The profile run's torch activation peak on one rank (vLLM's ``torch_peak_increase``) by formula, where it was
    not measured (``unmeasured``: why, e.g. "the fake run failed: ..."): the larger of the dummy forward's (two
    hidden-state tensors plus the largest layer's intermediates, per token) and the dummy sampler run's
    (min(max_num_seqs, max_num_batched_tokens) rows of logits in the dtype, float32, sorted values and int64
    indices), beside the last hidden states; the range is half to twice it."""
    tokens = max_num_batched_tokens
    forward = tokens * (2 * shapes.hidden_bytes_per_token + shapes.layer_bytes_per_token)
    rows = min(max_num_seqs, tokens)
    sampler = (rows * shapes.vocab_size * (shapes.dtype_size + SAMPLER_BYTES_PER_LOGIT_BEYOND_DTYPE)
               + tokens * shapes.hidden_bytes_per_token)
    peak = max(forward, sampler)
    which = "dummy forward" if forward >= sampler else "dummy sampler run"
    why = f" ({unmeasured})" if unmeasured else ""
    return Estimate(peak // 2, peak, 2 * peak,
                    f"{FORMULA}{why}: {which} at max_num_batched_tokens={tokens}, max_num_seqs={max_num_seqs}: the "
                    f"largest tensors that coexist, x0.5 to x2")


def non_torch(tensor_parallel_size: int) -> Estimate:
    """Non-torch memory per rank (NON_TORCH)."""
    low, mid, high = NON_TORCH[1 if tensor_parallel_size == 1 else 2]
    return Estimate(low, mid, high, f"constant for TP{'=1' if tensor_parallel_size == 1 else '>1'} (NCCL, cuBLAS, "
                                    f"custom all-reduce buffers)")


def cuda_graphs(enforce_eager: bool, estimated: bool = True) -> Estimate:
    """vLLM's CUDA-graph memory estimate per rank (CUDA_GRAPHS); exactly 0 with enforce_eager, or where vLLM does not
    subtract it (``estimated`` False: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0, or a release before 0.21, whose
    graphs are captured in the memory left after the KV cache)."""
    if enforce_eager:
        return Estimate.exact(0, "enforce_eager: no CUDA graphs")
    if not estimated:
        return Estimate.exact(0, f"not subtracted: {ESTIMATE_CUDA_GRAPHS}=0 or a vLLM before 0.21")
    low, mid, high = CUDA_GRAPHS
    return Estimate(low, mid, high, f"constant ({ESTIMATE_CUDA_GRAPHS}=1, vLLM's default)")
