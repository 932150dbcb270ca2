"""An estimate against a measurement: MemoryEstimate vs the StartupReport of the same engine settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_ref.errors import ConfigError
from engine_ref.utils import cdiv

if TYPE_CHECKING:
    from engine_ref.engine.report import StartupReport
    from engine_ref.memory.result import MemoryEstimate


@dataclass(frozen=True)
class MemoryDifference:
    """One category of one rank: the estimate, the measurement, and how far apart they may be."""

    rank: int
    category: str  # "weights" | "buffers" | "lora" | "activation_peak" | "kv_cache"
    estimated: int
    measured: int
    tolerance: int

    @property
    def ok(self) -> bool:
        return abs(self.estimated - self.measured) <= self.tolerance

    def describe(self) -> str:
        delta = self.measured - self.estimated
        return (f"rank {self.rank} {self.category}: estimated {self.estimated} B, measured {self.measured} B "
                f"({delta:+d} B, tolerance {self.tolerance} B)")


@dataclass(frozen=True)
class EstimateComparison:
    """Every category of every rank, estimated against measured; ``ok`` when all are within tolerance."""

    differences: tuple[MemoryDifference, ...]

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.differences)

    @property
    def mismatches(self) -> list[MemoryDifference]:
        return [d for d in self.differences if not d.ok]

    def describe(self) -> str:
        if self.ok:
            return "the estimate equals the measurement within tolerance on every rank"
        return "the estimate differs from the measurement: " + "; ".join(d.describe() for d in self.mismatches)


def compare_with_report(estimate: MemoryEstimate, report: StartupReport, *, activation_rtol: float = 0.0,
                        activation_atol: int | None = None) -> EstimateComparison:
    """Compare an estimate with the StartupReport of an engine started with the same arguments.

    Weights, buffers and LoRA slots must be equal. The activation peak may differ by
    ``max(activation_atol, activation_rtol * measured)`` bytes. The default ``activation_atol`` is
    ``estimate.all_reduce_bytes``: 0 at TP=1, where the estimate is exact on CPU; at TP > 1 a rank
    can measure up to one all-reduced activation more (gloo may release it late). On CUDA the
    measurement is torch.cuda's allocator peak, which rounds allocations and holds workspaces the
    estimate does not see: pass a tolerance.
    The KV cache may then differ by the blocks the activation tolerance is worth.
    Raises ConfigError when the two were made with different settings.
    """
    if activation_atol is None:
        activation_atol = estimate.all_reduce_bytes
    capacities = sorted({w.memory.capacity for w in report.workers})
    settings = {
        "architecture": (estimate.architecture, report.architecture),
        "tensor_parallel_size": (estimate.tensor_parallel_size, report.tensor_parallel_size),
        "number of ranks reported": (estimate.tensor_parallel_size, len(report.workers)),
        "max_model_len": (estimate.max_model_len, report.max_model_len),
        "block_size": (estimate.block_size, report.block_size),
        "device memory": (estimate.device_memory_bytes, capacities[0] if len(capacities) == 1 else capacities),
    }
    wrong = [f"{name} {ours!r} (estimate) vs {theirs!r} (report)" for name, (ours, theirs) in settings.items()
             if ours != theirs]
    if wrong:
        raise ConfigError(
            f"the estimate and the startup report were made with different settings: {'; '.join(wrong)}. "
            f"Estimate with the arguments the engine was started with."
        )
    differences = []
    for worker in sorted(report.workers, key=lambda w: w.rank):
        rank, measured = worker.rank, worker.memory
        tolerance = max(activation_atol, int(activation_rtol * measured.activation_peak))
        per_block = estimate.kv_cache_bytes_per_token_per_rank[rank] * estimate.block_size
        differences += [
            MemoryDifference(rank, "weights", estimate.weight_bytes_per_rank[rank], measured.weights, 0),
            MemoryDifference(rank, "buffers", estimate.buffer_bytes_per_rank[rank], measured.buffers, 0),
            MemoryDifference(rank, "lora", estimate.lora_bytes_per_rank[rank], measured.lora, 0),
            MemoryDifference(rank, "activation_peak", estimate.activation_peak_bytes_per_rank[rank],
                             measured.activation_peak, tolerance),
            MemoryDifference(rank, "kv_cache", estimate.kv_cache_bytes_per_rank[rank], measured.kv_cache,
                             cdiv(tolerance, per_block) * per_block),
        ]
    return EstimateComparison(tuple(differences))
