"""ModelRegistry's cache statistics: every ModelInfo lookup counted by what served it (memory, the JSON cache)
or why it was inspected (missing, source changed, format version, no source file, corrupt), per registry and
summed over the process; and the summary line the plugin prints from them."""

from __future__ import annotations

import importlib
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from engine_ref.model_executor.models.registry import (
    CACHE_OUTCOMES,
    MODEL_INFO_FORMAT_VERSION,
    RegisteredModel,
    _ModelRegistry,
    process_cache_stats,
)
from pytest_enginecheck.report import CACHE_OUTCOMES as REPORTED_OUTCOMES
from pytest_enginecheck.report import cache_line, cache_totals
from tests.helpers import TINY_MODEL_CLASS


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A uniquely named out-of-tree model module on sys.path, and a private cache root."""
    monkeypatch.setenv("ENGINE_REF_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / f"tiny_{uuid.uuid4().hex[:8]}.py"
    path.write_text(TINY_MODEL_CLASS)
    importlib.invalidate_caches()
    return path


def registry_for(path: Path) -> _ModelRegistry:
    """A fresh registry (nothing in memory) with TinyModel registered from ``path``."""
    return _ModelRegistry({"TinyModel": RegisteredModel(path.stem, "TinyModel")})


def counts(registry: _ModelRegistry) -> dict[str, int]:
    return {k: v for k, v in registry.cache_stats.to_dict().items() if v}


def cache_file(path: Path) -> Path:
    (found,) = (path.parent / "cache" / "modelinfos").glob("*.json")
    return found


def test_every_lookup_is_counted_by_what_served_it(tiny: Path) -> None:
    before = process_cache_stats()
    first = registry_for(tiny)
    first.inspect_model_cls("TinyModel")
    first.inspect_model_cls("TinyModel")
    assert counts(first) == {"missing": 1, "memory": 1} and first.cache_stats.inspected == 1

    second = registry_for(tiny)  # another process's view: nothing in memory, the file on disk
    second.inspect_model_cls("TinyModel")
    assert counts(second) == {"disk": 1}

    tiny.write_text(tiny.read_text() + "# an edit changes the source hash\n")
    second.inspect_model_cls("TinyModel")  # the memory entry was for the old source: not served
    assert counts(second) == {"disk": 1, "source_changed": 1}
    assert second.subprocess_inspections == 1

    data = json.loads(cache_file(tiny).read_text())
    cache_file(tiny).write_text(json.dumps({**data, "format_version": MODEL_INFO_FORMAT_VERSION + 1}))
    third = registry_for(tiny)
    third.inspect_model_cls("TinyModel")
    cache_file(tiny).write_text("{not json")
    fourth = registry_for(tiny)
    fourth.inspect_model_cls("TinyModel")
    assert (counts(third), counts(fourth)) == ({"format_version": 1}, {"corrupt": 1})
    assert fourth.cache_stats.inspected == 0  # corrupt entries are counted apart

    after = process_cache_stats()
    assert {k: after[k] - before[k] for k in CACHE_OUTCOMES if after[k] != before[k]} == {
        "missing": 1, "memory": 1, "disk": 1, "source_changed": 1, "format_version": 1, "corrupt": 1}


def test_a_module_without_a_source_file_counts_as_no_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_REF_CACHE_ROOT", str(tmp_path / "cache"))
    registry = _ModelRegistry({"NoSource": RegisteredModel("no_such_module_anywhere", "Model")})
    with pytest.raises(Exception, match="no_such_module_anywhere"):
        registry.inspect_model_cls("NoSource")
    assert counts(registry) == {"no_source": 1}


# the summary's cache line, up to its counts
CACHE = "ModelInfo cache (the registry's saved inspection of each class): "


def test_the_summary_line_and_the_run_totals() -> None:
    assert REPORTED_OUTCOMES == CACHE_OUTCOMES  # the plugin's copy (it imports no engine) matches the registry's
    results: list[dict[str, Any]] = [{"detail": {"cache": {"memory": 1, "disk": 200, "missing": 1}}},
               {"detail": {"cache": {"memory": 2, "disk": 210, "source_changed": 1}}},
               {"detail": {"other": 1}}]
    totals = cache_totals(results)
    assert totals == {"memory": 3, "disk": 410, "missing": 1, "source_changed": 1, "format_version": 0,
                      "no_source": 0, "corrupt": 0}
    assert cache_line(totals) == (f"{CACHE}413 lookups answered from it (3 in memory, "
                                  "410 on disk), 2 inspected the class (1 not cached yet, 1 source changed), 0 found a "
                                  "corrupt entry")
    assert cache_line(cache_totals([])) == (f"{CACHE}0 lookups answered from it (0 in "
                                            "memory, 0 on disk), 0 inspected the class, 0 found a corrupt entry")
