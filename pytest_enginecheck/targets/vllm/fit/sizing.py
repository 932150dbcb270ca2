"""vLLM's ``determine_available_memory`` (``gpu_worker.py``), as arithmetic on one rank's terms.

    requested   = ceil(total x gpu_memory_utilization)                       (request_memory)
    available   = requested - weights - activation peak - non-torch - CUDA graphs

``weights`` is exact (the meta build's parameter and buffer bytes, what vLLM's ``model_memory_usage`` measures
after ``load_model``); the other three are ``Estimate``s, so ``available`` is one too: its ``low`` takes every
term at its ``high`` and its ``high`` every term at its ``low``. vLLM then divides ``available`` by the bytes of one
block of every KV-cache group (``kv_cache.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pytest_enginecheck.targets.vllm.fit.estimates import FORMULA, MEASURED, Estimate


@dataclass(frozen=True)
class GpuTerms:
    """The terms of one rank that only a GPU measures (``estimates.py``)."""

    activation_peak: Estimate
    non_torch: Estimate
    cuda_graphs: Estimate

    @property
    def activation_peak_source(self) -> str:
        """"measured on fake tensors" (``estimates.measured_activation_peak``), else "formula estimate" (where the fake
        run failed; the basis says why)."""
        return MEASURED if self.activation_peak.basis.startswith(MEASURED) else FORMULA

    def to_dict(self) -> dict[str, dict[str, int | str]]:
        return {"activation_peak": self.activation_peak.to_dict(), "non_torch": self.non_torch.to_dict(),
                "cuda_graphs": self.cuda_graphs.to_dict()}


def requested_memory(total: int, gpu_memory_utilization: float) -> int:
    """vLLM's ``request_memory``: ``ceil(total x gpu_memory_utilization)``."""
    return math.ceil(total * gpu_memory_utilization)


def available_kv_cache_memory(total: int, gpu_memory_utilization: float, weights: int, terms: GpuTerms) -> Estimate:
    """The rank's memory left for the KV cache (vLLM's ``available_kv_cache_memory_bytes``), as a range; negative
    where the weights and the other terms already exceed the requested memory."""
    left = requested_memory(total, gpu_memory_utilization) - weights
    parts = (terms.activation_peak, terms.non_torch, terms.cuda_graphs)
    return Estimate(left - sum(p.high for p in parts), left - sum(p.estimate for p in parts),
                    left - sum(p.low for p in parts),
                    "requested - weights - activation peak - non-torch - CUDA graphs")
