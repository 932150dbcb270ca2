"""What changed since a baseline report: outcome changes and each budget rank's own memory by category, regressions
first (what ``merge --baseline`` prints and the HTML page lists)."""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.report_diff import changes, memory_changes


def _result(arch: str, check: str, outcome: str, **detail: Any) -> dict[str, Any]:
    return {"arch": arch, "check": check, "outcome": outcome, "duration_s": 0.1, "phases": {}, "message": "",
            "detail": detail}


def _budget(outcome: str = "passed", **rank: int) -> dict[str, Any]:
    memory = {"capacity": 2**29, "weights": 2**20, "buffers": 32, "lora": 0, "activation_peak": 8 * 2**20,
              "kv_cache": 2**28, **rank}
    return _result("A", "budget[tp=1]", outcome, budget="512MiB", memory_per_rank=[memory])


def test_regressions_come_first_then_new_removed_changed_and_improvements() -> None:
    baseline = [_result("A", "import", "failed"), _result("A", "inspect", "passed"),
                _result("A", "load[tp=1]", "passed"), _budget(), _result("C", "import", "passed")]
    results = [_result("A", "import", "passed"),
               _result("A", "inspect", "skipped", kind="dependency", root="enginecheck::A::import"),
               _result("A", "load[tp=1]", "failed"),
               _budget(activation_peak=9 * 2**20, weights=2**19, kv_cache=2**28 - 2**19),
               _result("B", "import", "failed"), _result("B", "inspect", "passed")]
    assert [(c.kind, c.item, c.text) for c in changes(results, baseline)] == [
        ("regression", "enginecheck::A::load[tp=1]", "passed -> failed"),
        ("regression", "enginecheck::A::budget[tp=1]",
         "rank 0: activation peak +12.5 % (+1.00 MiB; 8.00 MiB -> 9.00 MiB)"),
        ("regression", "enginecheck::B::import", "new item (not in the baseline): failed"),
        ("new", "enginecheck::B::inspect", "new item (not in the baseline): passed"),
        ("removed", "enginecheck::C::import", "removed (not in this report; was passed)"),
        ("changed", "enginecheck::A::inspect", "passed -> skipped (a root failed)"),
        ("improvement", "enginecheck::A::import", "failed -> passed"),
        ("improvement", "enginecheck::A::budget[tp=1]",
         "rank 0: weights -50.0 % (-512.00 KiB; 1.00 MiB -> 512.00 KiB)"),
    ]  # the KV cache, which fills what the capacity leaves, is no change of the model's


def test_an_unchanged_report_has_no_changes() -> None:
    results = [_result("A", "import", "passed"), _budget()]
    assert changes(results, results) == []


def test_memory_grown_from_nothing_has_no_percentage_and_a_rank_the_baseline_lacks_is_skipped() -> None:
    two_ranks = _budget(lora=4096)
    two_ranks["detail"]["memory_per_rank"].append({**two_ranks["detail"]["memory_per_rank"][0], "lora": 8192})
    found = memory_changes("enginecheck::A::budget[tp=1]", two_ranks, _budget())
    assert [c.text for c in found] == ["rank 0: LoRA (+4.00 KiB; 0 B -> 4.00 KiB)"]
