"""Memory budgets: what each rank of a started engine needs, against a per-rank budget.

A rank *needs* its weights, the activation peak of its profile run, and the KV cache of one
request of max_model_len tokens (the least it can serve with). The KV cache the engine actually
allocates is larger: it fills whatever the budget leaves.
"""

from __future__ import annotations

from typing import Any

from engine_ref.utils import cdiv, format_bytes


def rank_needs(report: Any, worker: Any) -> tuple[int, int]:
    """(total bytes needed, KV bytes of one max_model_len request) for one worker of a StartupReport."""
    memory = worker.memory
    per_block = memory.kv_cache // report.num_gpu_blocks if report.num_gpu_blocks else 0
    kv = cdiv(report.max_model_len, report.block_size) * per_block
    return memory.weights + memory.activation_peak + kv, kv


def budget_violations(report: Any, budget_bytes: int) -> list[str]:
    """One sentence per rank whose needs exceed the budget; empty when every rank fits."""
    violations = []
    for worker in report.workers:
        needs, kv = rank_needs(report, worker)
        if needs > budget_bytes:
            m = worker.memory
            violations.append(
                f"rank {worker.rank} needs {format_bytes(needs)} (weights {format_bytes(m.weights)}, "
                f"activations {format_bytes(m.activation_peak)}, KV {format_bytes(kv)} for one request of "
                f"max_model_len {report.max_model_len}) but the budget is {format_bytes(budget_bytes)}")
    return violations


def describe_shortfall(shortfall: Any, budget_bytes: int) -> str:
    """The budget sentence for an engine that could not start (KVCacheTooSmallError.shortfall)."""
    return (f"rank {shortfall.rank} needs {format_bytes(shortfall.total)} (weights "
            f"{format_bytes(shortfall.weights)}, activations {format_bytes(shortfall.activation_peak)}, KV "
            f"{format_bytes(shortfall.kv_cache)} for one request of max_model_len) but the budget is "
            f"{format_bytes(budget_bytes)}")
