"""Memory budgets: what each rank of a started engine needs, against a per-rank budget.

A rank *needs* its weights, buffers, LoRA adapter slots (with LoRA), the activation peak of its
profile run, and the KV cache of one request of max_model_len tokens (the least it can serve with),
as the engine's own KV cache sizing says (``StartupReport.kv_cache``). The KV cache the engine
actually allocates is larger: it fills whatever the budget leaves.
"""

from __future__ import annotations

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

