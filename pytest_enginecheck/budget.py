"""Memory budgets: what each rank of a started engine needs, against a per-rank budget.

A rank *needs* its weights, buffers, LoRA adapter slots (with LoRA), the activation peak of its
profile run, and the KV cache of one request of max_model_len tokens (the least it can serve with),
as the engine's own KV cache sizing says (``StartupReport.kv_cache``). The KV cache the engine
actually allocates is larger: it fills whatever the budget leaves.

While it serves requests, a rank needs the same, with the activation peak of its prefill or decode
steps instead of the profile run's, plus what earlier steps still hold ("other"); and the same requests
run twice must leave it holding no more after the second round than after the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine_ref.utils import format_bytes


def describe_shortfall(needs: Any, budget_bytes: int, max_model_len: int | None = None) -> str:
    """The budget sentence for one rank's needs (a MemoryShortfall, as KVCacheTooSmallError.shortfall)."""
    length = "" if max_model_len is None else f" {max_model_len}"
    lora = f", LoRA slots {format_bytes(needs.lora)}" if getattr(needs, "lora", 0) else ""
    return (f"rank {needs.rank} needs {format_bytes(needs.total)} (weights {format_bytes(needs.weights)}, "
            f"activations {format_bytes(needs.activation_peak)}, KV {format_bytes(needs.kv_cache)} for one "
            f"request of max_model_len{length}, buffers {format_bytes(needs.buffers)}{lora}) but the budget is "
            f"{format_bytes(budget_bytes)}")


def budget_violations(report: Any, budget_bytes: int) -> list[str]:
    """One sentence per rank of a StartupReport whose needs exceed the budget; empty when every rank fits."""
    needs = [report.kv_cache.needs(worker.rank, worker.memory) for worker in report.workers]
    return [describe_shortfall(n, budget_bytes, report.max_model_len) for n in needs if n.total > budget_bytes]



def workload_violations(report: Any, workers: Sequence[Any], budget_bytes: int) -> list[str]:
    """One sentence per rank and step phase whose peak exceeds the budget: ``workers`` are the ranks' WorkerReports
    after the workload (each with its ``workload``), ``report`` the StartupReport (its KV cache sizing)."""
    sentences = []
    for worker in workers:
        needs = report.kv_cache.needs(worker.rank, worker.memory)
        static = needs.total - needs.activation_peak
        lora = f", LoRA slots {format_bytes(needs.lora)}" if needs.lora else ""
        for phase, peak in worker.workload.peaks.items():
            if static + peak.total > budget_bytes:
                sentences.append(
                    f"rank {worker.rank} needs {format_bytes(static + peak.total)} in {phase} steps (weights "
                    f"{format_bytes(needs.weights)}, activations {format_bytes(peak.activations)} where the profile "
                    f"run measured {format_bytes(needs.activation_peak)}, other {format_bytes(peak.held)} held from "
                    f"earlier steps, KV {format_bytes(needs.kv_cache)} for one request of max_model_len "
                    f"{report.max_model_len}, buffers {format_bytes(needs.buffers)}{lora}) but the budget is "
                    f"{format_bytes(budget_bytes)}")
    return sentences


def per_request_leaks(first: Sequence[Any], second: Sequence[Any], tolerance: int = 0) -> list[str]:
    """One sentence per rank whose steps hold more than ``tolerance`` bytes more after a second round of the same
    requests than after the first: ``first`` and ``second`` are the ranks' WorkerReports after each round."""
    sentences = []
    for before, after in zip(first, second, strict=True):
        growth = after.workload.held - before.workload.held
        steps = after.workload.steps - before.workload.steps
        if growth > tolerance:
            sentences.append(
                f"rank {after.rank} holds {format_bytes(growth)} more after the second round than after the first "
                f"({format_bytes(growth // max(1, steps))} per step over its {steps} steps), not KV cache")
    return sentences
