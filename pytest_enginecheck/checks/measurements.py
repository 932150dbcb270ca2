"""What a check result carries about its own cost, beside its verdict (the runner adds them).

- In the child (``with_cache_counts``): the engine's ModelInfo lookups the check made, by how they were
  served (its target's ``Target.cache_counts``), as the detail's ``"cache"``; the pytest process sums them
  over the run (``report.cache_totals``).
- In the pytest process (``with_call_stats``): the child's start and answer time as the phases
  ``process.start`` and ``process.answer`` (parts of ``process``), and the cloudpickle bytes sent to and
  from it as the detail's ``"payload_bytes"`` (engine_ref.isolation's ``CallStats``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pytest_enginecheck.checks import CheckContext, CheckResult
from pytest_enginecheck.targets import load_target

if TYPE_CHECKING:
    from engine_ref.isolation import CallStats


def cache_counts(ctx: CheckContext) -> dict[str, int] | None:
    """This process's ModelInfo lookups so far, by outcome, as ``ctx``'s target counts them (None: it cannot)."""
    return load_target(ctx.spec).cache_counts()


def with_cache_counts(ctx: CheckContext, result: CheckResult, before: dict[str, int] | None) -> CheckResult:
    """``result`` with the lookups made since ``before`` (``cache_counts()`` when the check began) as its
    detail's ``"cache"``; unchanged when it made none."""
    after = cache_counts(ctx)
    if after is None:
        return result
    made = {outcome: n - (before or {}).get(outcome, 0) for outcome, n in after.items()}
    if not any(made.values()):
        return result
    return dataclasses.replace(result, detail={**result.detail, "cache": made})


def with_call_stats(result: CheckResult, stats: CallStats | None) -> CheckResult:
    """``result`` with its child's start and answer time in its phases and the payload bytes in its detail
    (``stats``: ``last_call_stats()`` of the run_isolated call that ran it; unchanged when None)."""
    if stats is None:
        return result
    phases = dict(result.phases)
    if stats.start_s is not None:
        phases["process.start"] = max(0.0, stats.start_s)
    if stats.answer_s is not None:
        phases["process.answer"] = max(0.0, stats.answer_s)
    payload = {"sent": stats.sent_bytes, "received": stats.received_bytes}
    return dataclasses.replace(result, phases=phases, detail={**result.detail, "payload_bytes": payload})
