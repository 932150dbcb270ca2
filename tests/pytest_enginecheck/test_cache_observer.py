"""observe_cache_file tells how a file-backed ModelInfo cache served a lookup from its file alone (what the vLLM
target uses for vLLM's ``modelinfos``). The oracle: engine_ref's registry, whose own counters say the same; and
the summary line for lookups no file could tell."""

from __future__ import annotations

import importlib
import uuid
from pathlib import Path

import pytest

from engine_ref.model_executor.models.registry import RegisteredModel, _ModelRegistry
from pytest_enginecheck.cache_observer import observe_cache_file
from pytest_enginecheck.report import cache_line, cache_totals, cache_unknown, summary_table
from tests.helpers import TINY_MODEL_CLASS


def test_the_file_tells_what_the_registry_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_REF_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / f"tiny_{uuid.uuid4().hex[:8]}.py"
    source.write_text(TINY_MODEL_CLASS)
    importlib.invalidate_caches()
    entry = RegisteredModel(source.stem, "TinyModel")
    path = _ModelRegistry._cache_path("TinyModel", entry)

    def lookup() -> tuple[str | None, dict[str, int]]:
        registry = _ModelRegistry({"TinyModel": entry})  # nothing in memory: as a new check child
        with observe_cache_file(path, hash_key="source_hash") as seen:
            registry.inspect_model_cls("TinyModel")
        return seen.outcome, {k: v for k, v in registry.cache_stats.to_dict().items() if v}

    assert lookup() == ("missing", {"missing": 1})
    assert lookup() == ("disk", {"disk": 1})
    source.write_text(source.read_text() + "# an edit\n")
    assert lookup() == ("source_changed", {"source_changed": 1})
    path.write_text("{not json")
    assert lookup() == ("corrupt", {"corrupt": 1})


def test_no_file_before_or_after_and_a_block_that_raises(tmp_path: Path) -> None:
    with observe_cache_file(tmp_path / "none.json") as seen:
        pass
    assert (seen.outcome, seen.counts()) == ("no_source", {"no_source": 1})
    with pytest.raises(RuntimeError), observe_cache_file(tmp_path / "x.json") as failed:
        raise RuntimeError
    assert (failed.outcome, failed.counts()) == (None, {})


# the summary's cache line, up to its counts
CACHE = "ModelInfo cache (the registry's saved inspection of each class): "


def result(cache: object) -> dict[str, object]:
    return {"arch": "A", "check": "inspect", "outcome": "passed", "duration_s": 0.1, "phases": {}, "message": "",
            "detail": {"cache": cache}}


def test_lookups_that_cannot_be_told() -> None:
    why = "vLLM's modelinfos are not read with --enginecheck-inspect=fork"
    only_unknown = [result(why), result(why)]
    assert summary_table(only_unknown)[-1] == (
        f"{CACHE}cannot tell whether it answered the lookups or the classes were inspected: {why}")
    mixed = [result({"disk": 2}), result(why)]
    assert cache_unknown(mixed) == [why]
    assert cache_line(cache_totals(mixed), cache_unknown(mixed)) == (
        f"{CACHE}2 lookups answered from it (0 in memory, 2 on disk), 0 inspected the class, "
        f"0 found a corrupt entry; cannot tell for the others: {why}")
