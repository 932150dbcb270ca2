"""What changed since a baseline report (``merge --baseline OLD.json``), and what a budget item's memory holds.

Per item: its outcome change (to failed is a regression, from failed an improvement; a new or removed item is
called so) and, for a budget item, each rank's change of the model's own memory by category (weights, buffers,
activation peak, LoRA, vLLM's one request of KV: what changes when a model regresses; the KV cache fills what is
left of the capacity, so it is not compared). Regressions are listed first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from engine_ref.utils import format_bytes
from pytest_enginecheck.checks import CHECKS

# (key in a budget result's memory_per_rank, label): the model's own memory (engine_ref's, and vLLM's one request
# of KV, which vLLM's budget counts); the bars of the HTML report are scaled to their sum
OWN = (("weights", "weights"), ("buffers", "buffers"), ("activation_peak", "activation peak"), ("lora", "LoRA"),
       ("kv_one_request", "KV (one request)"))
# the KV cache: engine_ref's fills what the capacity leaves; vLLM's is what it allocated (not in its budget's need)
KV = (("kv_cache", "KV cache"), ("kv_cache_allocated", "KV cache allocated (not counted)"))
KINDS = ("regression", "new", "removed", "changed", "improvement")  # the order changes are listed in


def plural(n: int, word: str) -> str:
    """``1 architecture``, ``2 architectures``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def ranks(result: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(rank, its memory) per rank of a budget result (``detail.memory_per_rank``); none for any other item."""
    detail = result.get("detail")
    per_rank = detail.get("memory_per_rank") if isinstance(detail, dict) else None
    if not isinstance(per_rank, list):
        return []
    return [(m["rank"] if isinstance(m.get("rank"), int) else i, m)
            for i, m in enumerate(per_rank) if isinstance(m, dict)]


def own_parts(memory: dict[str, Any]) -> list[tuple[str, int]]:
    """(label, bytes) of each of the model's own categories a rank's memory has, in OWN order."""
    return [(label, memory[key]) for key, label in OWN if isinstance(memory.get(key), int)]


@dataclass(frozen=True)
class Baseline:
    """An earlier ``--enginecheck-json`` report to compare with: its path (as given) and its results."""

    path: str
    results: Sequence[dict[str, Any]]


@dataclass(frozen=True)
class Change:
    """One way an item differs from the baseline; ``kind`` is one of KINDS."""

    item: str  # the node id, enginecheck::<arch>::<check>
    kind: str
    text: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def nodeid(result: dict[str, Any]) -> str:
    """The item's pytest node id, ``enginecheck::<arch>::<check>``."""
    return f"enginecheck::{result['arch']}::{result['check']}"


def _order(item: str) -> tuple[str, int, str]:
    arch, check = item.split("::")[1:3]
    base = check.split("[")[0]
    return (arch, CHECKS.index(base) if base in CHECKS else len(CHECKS), check)


def outcome_kind(result: dict[str, Any]) -> str:
    """The result's outcome, or ``dependency`` for an item skipped because a check it depends on (its root) failed."""
    detail = result.get("detail")
    root_failed = result["outcome"] == "skipped" and isinstance(detail, dict) and detail.get("kind") == "dependency"
    return "dependency" if root_failed else str(result["outcome"])


def _outcome(result: dict[str, Any]) -> str:
    kind = outcome_kind(result)
    return "skipped (a root failed)" if kind == "dependency" else kind


def _outcome_change(item: str, now: dict[str, Any] | None, was: dict[str, Any] | None) -> list[Change]:
    if was is None and now is not None:
        kind = "regression" if now["outcome"] == "failed" else "new"
        return [Change(item, kind, f"new item (not in the baseline): {_outcome(now)}")]
    if now is None and was is not None:
        return [Change(item, "removed", f"removed (not in this report; was {_outcome(was)})")]
    if now is None or was is None or _outcome(now) == _outcome(was):
        return []
    kind = ("regression" if now["outcome"] == "failed" else "improvement" if was["outcome"] == "failed"
            else "changed")
    return [Change(item, kind, f"{_outcome(was)} -> {_outcome(now)}")]


def memory_changes(item: str, now: dict[str, Any], was: dict[str, Any]) -> list[Change]:
    """Per rank both reports have, each own category whose bytes changed: growth is a regression."""
    before = dict(ranks(was))
    found = []
    for rank, memory in ranks(now):
        old = dict(own_parts(before[rank])) if rank in before else {}
        for label, size in own_parts(memory):
            if label not in old or old[label] == size:
                continue
            delta = size - old[label]
            share = f"{100 * delta / old[label]:+.1f} % " if old[label] else ""
            text = (f"rank {rank}: {label} {share}({'+' if delta > 0 else '-'}{format_bytes(abs(delta))}; "
                    f"{format_bytes(old[label])} -> {format_bytes(size)})")
            found.append(Change(item, "regression" if delta > 0 else "improvement", text))
    return found


def changes(results: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]]) -> list[Change]:
    """How ``results`` differ from ``baseline`` (both ``--enginecheck-json`` results), in KINDS order (regressions
    first), within a kind by architecture and check (in CHECKS order), an item's outcome change before its memory's."""
    now = {nodeid(r): r for r in results}
    was = {nodeid(r): r for r in baseline}
    found: list[Change] = []
    for item in sorted(now.keys() | was.keys(), key=_order):
        found += _outcome_change(item, now.get(item), was.get(item))
        if item in now and item in was:
            found += memory_changes(item, now[item], was[item])
    return sorted(found, key=lambda c: KINDS.index(c.kind))  # a stable sort: the item order stays


def changes_line(found: Sequence[Change]) -> str:
    """``2 regressions, 1 new, 3 improvements`` (the kinds present, in KINDS order), or ``no changes``."""
    counts = [(sum(c.kind == k for c in found), k) for k in KINDS]
    return ", ".join(plural(n, k) if k in ("regression", "improvement") else f"{n} {k}" for n, k in counts if n
                     ) or "no changes"
