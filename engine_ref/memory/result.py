"""MemoryEstimate: the predicted memory of every rank of an engine, and whether max_model_len fits.

``fake_engine`` makes one, ``compare`` holds one against a StartupReport, ``estimate_memory``
(estimate.py) is the entry point.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine_ref.utils import format_bytes

#: The keys of ``MemoryEstimate.to_dict()`` (and of ``engine-ref estimate --json``), in order.
JSON_KEYS = (
    "architecture", "num_parameters", "dtype", "tensor_parallel_size", "weight_bytes", "buffer_bytes",
    "weight_bytes_per_rank", "buffer_bytes_per_rank", "lora_bytes_per_rank", "activation_peak_bytes_per_rank",
    "kv_cache_bytes_per_token_per_rank", "block_size", "num_gpu_blocks", "max_concurrency", "fits", "reason",
    "max_model_len_estimate",
)

#: Device memory by category, in the order a rank claims it; ``MemoryEstimate.overflow`` is one of them
#: ("weights" when the weights and buffers alone exceed the budget, "lora" when the LoRA slots do not fit beside them).
CATEGORIES = ("weights", "lora", "activation_peak", "kv_cache")


@dataclass
class MemoryEstimate:
    """The predicted memory of every rank of an engine, and whether max_model_len fits.

    Figures are bytes, counted as the engine counts them. ``weight_bytes`` is the parameters of the
    whole model as one rank would hold it at TP=1 (a tied tensor once), ``buffer_bytes`` its buffers
    (rotary tables and the like); ``*_per_rank`` lists have one entry per rank. ``lora_bytes_per_rank``
    is each rank's preallocated LoRA slots (all 0 without ``enable_lora``). ``num_gpu_blocks`` is
    the KV cache the engine would allocate (the most constrained rank decides), ``max_concurrency``
    how many requests of ``max_model_len`` tokens it holds. When ``fits`` is false, ``overflow``
    names the category that does not fit (one of CATEGORIES), ``reason`` says why and what to
    change, and ``max_model_len_estimate`` is the largest max_model_len that fits, verified by
    re-running the profile at that length (0: none does, among the lengths searched; see
    fake_engine.MAX_SEARCH_SEQUENCES). When it fits, ``max_model_len_estimate`` is the requested
    max_model_len.

    ``all_reduce_bytes`` is one all-reduced activation of the profile run (max_num_batched_tokens x
    hidden_size), 0 at TP=1. A real multi-rank run can measure a peak up to that much higher than
    the estimate: a collective backend may drop its reference to the tensor it reduced a moment
    after returning (gloo releases it from its worker thread), so the tensor can outlive the next
    allocation. The estimate is the peak when it does not.
    """

    architecture: str
    num_parameters: int
    dtype: str
    tensor_parallel_size: int
    weight_bytes: int
    buffer_bytes: int
    weight_bytes_per_rank: list[int]
    buffer_bytes_per_rank: list[int]
    lora_bytes_per_rank: list[int]
    activation_peak_bytes_per_rank: list[int]
    kv_cache_bytes_per_token_per_rank: list[int]
    block_size: int
    num_gpu_blocks: int
    max_concurrency: float
    fits: bool
    reason: str | None
    max_model_len_estimate: int
    # the inputs the figures depend on (not in the JSON, which has exactly JSON_KEYS)
    max_model_len: int = 0
    max_num_batched_tokens: int = 0
    device_memory_bytes: int = 0
    gpu_memory_utilization: float = 0.9
    budget_bytes: int = 0  # what each rank may use: device_memory_bytes * gpu_memory_utilization
    overflow: str | None = None
    all_reduce_bytes: int = 0
    seconds: float = field(default=0.0, compare=False)

    @property
    def kv_cache_bytes_per_rank(self) -> list[int]:
        """The KV cache each rank would allocate: num_gpu_blocks blocks of block_size tokens."""
        return [self.num_gpu_blocks * self.block_size * b for b in self.kv_cache_bytes_per_token_per_rank]

    def to_dict(self) -> dict[str, Any]:
        """The JSON of ``engine-ref estimate --json``: exactly the keys in JSON_KEYS."""
        return {key: getattr(self, key) for key in JSON_KEYS}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format_table(self) -> str:
        """A readable summary: the verdict, then one row of bytes per rank."""
        verdict = "fits" if self.fits else f"does NOT fit: {self.reason}"
        with_lora = any(self.lora_bytes_per_rank)
        lora_header = f"{'LoRA':>12}" if with_lora else ""
        lines = [
            f"{self.architecture}: {self.num_parameters:,} parameters, {format_bytes(self.weight_bytes)} in "
            f"{self.dtype}, buffers {format_bytes(self.buffer_bytes)}",
            f"tensor_parallel_size={self.tensor_parallel_size} device_memory={format_bytes(self.device_memory_bytes)} "
            f"gpu_memory_utilization={self.gpu_memory_utilization} max_model_len={self.max_model_len} "
            f"max_num_batched_tokens={self.max_num_batched_tokens}",
            "",
            f"{'rank':<6}{'weights':>12}{'buffers':>12}{lora_header}{'activations':>13}{'KV/token':>11}{'KV cache':>12}"
            f"{'total':>12}{'budget':>12}",
        ]
        for rank in range(self.tensor_parallel_size):
            weights, buffers = self.weight_bytes_per_rank[rank], self.buffer_bytes_per_rank[rank]
            peak, kv = self.activation_peak_bytes_per_rank[rank], self.kv_cache_bytes_per_rank[rank]
            lora = self.lora_bytes_per_rank[rank]
            lora_cell = f"{format_bytes(lora):>12}" if with_lora else ""
            lines.append(
                f"{rank:<6}{format_bytes(weights):>12}{format_bytes(buffers):>12}{lora_cell}{format_bytes(peak):>13}"
                f"{self.kv_cache_bytes_per_token_per_rank[rank]:>9} B{format_bytes(kv):>12}"
                f"{format_bytes(weights + buffers + lora + peak + kv):>12}{format_bytes(self.budget_bytes):>12}"
            )
        lines += [
            "",
            f"KV cache: {self.num_gpu_blocks} blocks of {self.block_size} tokens; max concurrency at "
            f"max_model_len {self.max_model_len}: {self.max_concurrency:.2f}x",
            f"verdict: {verdict}",
        ]
        if not self.fits:
            lines.append(f"largest max_model_len that fits: {self.max_model_len_estimate}")
        return "\n".join(lines)
