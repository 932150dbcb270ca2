"""A prediction: per rank, what vLLM's startup would log on the GPU, and the run's verdict; as text or JSON.

Exact figures (weights, buffers, KV bytes per token, one request's KV) print as plain numbers; every figure that
depends on a term only a GPU measures (``estimates.py``) prints as its stated estimate with its range, never as a
lone number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pytest_enginecheck.targets.vllm.fit.estimates import Estimate, GiB
from pytest_enginecheck.targets.vllm.fit.sizing import GpuTerms

VERDICTS = ("fits", "may not fit", "does not fit")


@dataclass(frozen=True)
class RankFit:
    """One rank at full size: its exact bytes (from vLLM's model and KV-cache specs) and the KV cache vLLM's formula
    gives it (ranges)."""

    rank: int
    weights_bytes: int  # parameters (vLLM's own layouts for this rank)
    buffers_bytes: int  # buffers (rotary caches, ...): in vLLM's "Model loading took" too
    kv_bytes_per_token: int  # one block of every KV-cache group / block_size
    kv_one_request_bytes: int  # what one request of max_model_len needs (the spec's max_memory_usage_bytes)
    kv_layers: int  # layers holding a KV cache (a layer sharing another's has none)
    kv_spec: str  # the spec kinds, e.g. "80 x FullAttentionSpec(num_kv_heads=2, head_size=128, bfloat16)"
    terms: GpuTerms
    available_kv_cache_memory: Estimate
    num_blocks: Estimate
    kv_cache_bytes: Estimate  # num_blocks x the bytes of one block of every group: what vLLM allocates
    kv_tokens: Estimate  # vLLM's "GPU KV cache size: N tokens"
    max_concurrency_x100: Estimate  # vLLM's "Maximum concurrency for max_model_len tokens per request", x100
    max_model_len_that_fits: Estimate  # vLLM's estimate_max_model_len, up to the model's own maximum

    @property
    def model_loading_bytes(self) -> int:
        """vLLM's "Model loading took" (its model_memory_usage): parameters and buffers."""
        return self.weights_bytes + self.buffers_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "weights_bytes": self.weights_bytes, "buffers_bytes": self.buffers_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token, "kv_one_request_bytes": self.kv_one_request_bytes,
                "kv_layers": self.kv_layers, "kv_spec": self.kv_spec, "terms": self.terms.to_dict(),
                "available_kv_cache_memory": self.available_kv_cache_memory.to_dict(),
                "num_blocks": self.num_blocks.to_dict(), "kv_cache_bytes": self.kv_cache_bytes.to_dict(),
                "kv_tokens": self.kv_tokens.to_dict(),
                "max_model_len_that_fits": self.max_model_len_that_fits.to_dict()}

    def same_as(self, other: RankFit) -> bool:
        """The same figures, the rank number aside."""
        mine, theirs = self.to_dict(), other.to_dict()
        mine.pop("rank"), theirs.pop("rank")
        return mine == theirs


@dataclass(frozen=True)
class FitReport:
    """vLLM at TP=N on GPUs of ``gpu_memory`` bytes, predicted from a config.json: every rank, and whether one request
    of ``max_model_len`` fits (``verdict``: in the worst case too, only at some point of the range, or nowhere)."""

    config: str
    architecture: str
    tensor_parallel_size: int
    gpu_memory: int
    gpu_memory_utilization: float
    max_model_len: int
    derived_max_model_len: int  # the model's own maximum (vLLM's derived max_model_len)
    dtype: str
    kv_cache_dtype: str
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enforce_eager: bool
    ranks: list[RankFit]
    max_model_len_that_fits: Estimate  # the smallest over the ranks, bounded by derived_max_model_len
    seconds: float = 0.0  # the prediction, vLLM's imports aside
    import_seconds: float = 0.0  # importing vLLM's modules the prediction calls (once per process)
    # max_model_len_that_fits at every TP size tried (predict.smallest_tp), this one included; empty: none tried
    sizes: dict[int, Estimate] = field(default_factory=dict)
    platform: str = ""  # why the fit took another vLLM platform than the one vLLM resolves here (platform.choose)

    @property
    def verdict(self) -> str:
        """"fits" (also with every GPU-only term at its high), "does not fit" (not even at their lows), or
        "may not fit" (within the range)."""
        return verdict(self.max_model_len_that_fits, self.max_model_len)

    @property
    def fits(self) -> bool:
        """One request of max_model_len fits even with every GPU-only term at the high end of its range."""
        return self.verdict == "fits"

    def render(self) -> str:
        """The prediction as vLLM's startup log lines would read (``render``)."""
        return render(self)

    def smallest_tp(self, worst_case: bool) -> int | None:
        """The smallest TP size tried where max_model_len fits: in the worst case (every GPU-only term at its high),
        or at the estimate; None where none tried does (or none was tried)."""
        return next((tp for tp, fits in sorted(self.sizes.items())
                     if (fits.low if worst_case else fits.estimate) >= self.max_model_len), None)

    def to_dict(self) -> dict[str, Any]:
        """The prediction for machines (``--json``)."""
        return {"config": self.config, "architecture": self.architecture,
                "tensor_parallel_size": self.tensor_parallel_size, "gpu_memory_bytes": self.gpu_memory,
                "gpu_memory_utilization": self.gpu_memory_utilization, "max_model_len": self.max_model_len,
                "derived_max_model_len": self.derived_max_model_len, "dtype": self.dtype,
                "kv_cache_dtype": self.kv_cache_dtype, "block_size": self.block_size,
                "max_num_batched_tokens": self.max_num_batched_tokens, "max_num_seqs": self.max_num_seqs,
                "enforce_eager": self.enforce_eager, "ranks": [r.to_dict() for r in self.ranks],
                "max_model_len_that_fits": self.max_model_len_that_fits.to_dict(), "verdict": self.verdict,
                "smallest_tensor_parallel_size": {"estimate": self.smallest_tp(False),
                                                  "worst_case": self.smallest_tp(True),
                                                  "tried": sorted(self.sizes)},
                "seconds": round(self.seconds, 3), "import_seconds": round(self.import_seconds, 3),
                "platform": self.platform}


def verdict(max_len_that_fits: Estimate, max_model_len: int) -> str:
    """"fits" when even the worst case (``low``) fits ``max_model_len``, "does not fit" when not even the best
    (``high``) does, else "may not fit"."""
    if max_len_that_fits.low >= max_model_len:
        return "fits"
    if max_len_that_fits.high < max_model_len:
        return "does not fit"
    return "may not fit"


def gib(num_bytes: float) -> str:
    """Bytes as vLLM's logs print them (format_gib: GiB, two decimals)."""
    return f"{num_bytes / GiB:.2f} GiB"


def _range(e: Estimate, unit: str = "GiB") -> str:
    """``e`` as its stated estimate and range; a term with no spread (low == high) as its one value."""
    if e.low == e.high:
        return {"GiB": gib(e.low), "x": f"{e.low / 100:.2f}x"}.get(unit, f"{e.low:,} {unit}")
    if unit == "GiB":
        return f"~{gib(e.estimate)} (range {e.low / GiB:.2f} to {e.high / GiB:.2f} GiB)"
    if unit == "x":
        return f"~{e.estimate / 100:.2f}x (range {e.low / 100:.2f}x to {e.high / 100:.2f}x)"
    return f"~{e.estimate:,} {unit} (range {e.low:,} to {e.high:,})"


def _rank_groups(ranks: list[RankFit]) -> list[tuple[str, RankFit]]:
    """Consecutive ranks with the same figures, as ("rank 0-3", the first of them)."""
    groups: list[list[RankFit]] = []
    for r in ranks:
        if groups and groups[-1][0].same_as(r):
            groups[-1].append(r)
        else:
            groups.append([r])
    return [(f"rank {g[0].rank}" + (f"-{g[-1].rank}" if len(g) > 1 else ""), g[0]) for g in groups]


def render(report: FitReport) -> str:
    """The prediction as vLLM's own startup log lines would read, one block per group of identical ranks."""
    r = report
    lines = [f"{r.config}: {r.architecture} at tensor_parallel_size={r.tensor_parallel_size} on {gib(r.gpu_memory)} "
             f"GPUs, gpu_memory_utilization={r.gpu_memory_utilization:g}, max_model_len={r.max_model_len:,}, "
             f"dtype={r.dtype}, kv_cache_dtype={r.kv_cache_dtype}, block_size={r.block_size}, "
             f"max_num_batched_tokens={r.max_num_batched_tokens}, max_num_seqs={r.max_num_seqs}"
             f"{', enforce_eager' if r.enforce_eager else ''}"]
    for label, rank in _rank_groups(r.ranks):
        t = rank.terms
        lines += [
            f"[{label}] Model loading took {gib(rank.model_loading_bytes)} memory (exact: {rank.weights_bytes:,} B of "
            f"parameters + {rank.buffers_bytes:,} B of buffers)",
            f"[{label}] KV cache: {rank.kv_spec}: {rank.kv_bytes_per_token:,} B per token (exact); one request of "
            f"{r.max_model_len:,} tokens needs {gib(rank.kv_one_request_bytes)}",
            f"[{label}] GPU-only terms (stated estimates): activation peak {_range(t.activation_peak)} "
            f"({t.activation_peak_source}), non-torch "
            f"{_range(t.non_torch)}, CUDA graphs {_range(t.cuda_graphs)}",
            f"[{label}] Available KV cache memory: {_range(rank.available_kv_cache_memory)}",
            f"[{label}] GPU KV cache size: {_range(rank.kv_tokens, 'tokens')}, Maximum concurrency for "
            f"{r.max_model_len:,} tokens per request: {_range(rank.max_concurrency_x100, 'x')}",
        ]
    heaviest = max(r.ranks, key=lambda rank: rank.model_loading_bytes)
    if heaviest.model_loading_bytes > r.gpu_memory:
        lines.append(f"The weights alone ({gib(heaviest.model_loading_bytes)} on rank {heaviest.rank}) exceed the "
                     f"GPU's {gib(r.gpu_memory)}: vLLM's worker runs out of memory while loading the model")
    elif heaviest.model_loading_bytes > math.ceil(r.gpu_memory * r.gpu_memory_utilization):
        lines.append(f"The weights alone ({gib(heaviest.model_loading_bytes)} on rank {heaviest.rank}) exceed "
                     f"gpu_memory_utilization x {gib(r.gpu_memory)}: vLLM fails with 'No available memory for the "
                     f"cache blocks'")
    fits = r.max_model_len_that_fits
    bound = f" (the model's maximum is {r.derived_max_model_len:,})"
    lines.append(f"Largest max_model_len that fits: {_range(fits, 'tokens')}{bound}")
    lines.append({"fits": f"max_model_len={r.max_model_len:,} fits, also with every GPU-only term at the high end of "
                          f"its range",
                  "may not fit": f"max_model_len={r.max_model_len:,} may not fit: it fits only at the low end of the "
                                 f"GPU-only terms' range; vLLM would fail with 'To serve at least one request with the "
                                 f"model's max seq len ...' beyond it",
                  "does not fit": f"max_model_len={r.max_model_len:,} does not fit, not even with every GPU-only "
                                  f"term at its low end: vLLM fails at startup ('To serve at least one request with "
                                  f"the model's max seq len ...')"}[r.verdict])
    if r.sizes:
        worst, est = r.smallest_tp(True), r.smallest_tp(False)
        tried = ", ".join(str(tp) for tp in sorted(r.sizes))
        lines.append(f"Smallest tensor_parallel_size that fits (tried {tried}): "
                     f"{est if est is not None else 'none'} at the estimate, "
                     f"{worst if worst is not None else 'none'} in the worst case")
    lines.append(f"(predicted in {r.seconds:.1f} s after {r.import_seconds:.1f} s of importing vLLM, from vLLM's own "
                 f"model class on the meta device; docs/fit.md)")
    if r.platform:
        lines.append(f"({r.platform})")
    return "\n".join(lines)
