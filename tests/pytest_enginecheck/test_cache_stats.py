"""What a ``pytest --enginecheck`` run says about its own cost: the ModelInfo cache line (a second run over the zoo is
all hits, an edited model reads as "source changed"), the JSON report's ``cache``, and each result's child start
and answer time and payload bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import TINY_MODEL_CLASS

BUNDLED = 5


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ModelInfo cache root of this test's own, which the runs (and their check children) inherit."""
    root = tmp_path / "modelinfo-cache"
    monkeypatch.setenv("ENGINE_REF_CACHE_ROOT", str(root))
    monkeypatch.setenv("ENGINE_REF_PLUGINS", "")
    return root


# the summary's cache line, up to its counts
CACHE = "ModelInfo cache (the registry's saved inspection of each class): "


def said(result: pytest.RunResult) -> str:
    """The run's output with the lines the summary wrapped to the terminal's width joined back."""
    return " ".join(line.strip() for line in result.outlines)


def run(pytester: pytest.Pytester, name: str, *args: str) -> tuple[pytest.RunResult, dict[str, Any]]:
    """One ``pytest --enginecheck`` run of the import and inspect checks; its output and JSON report."""
    report = pytester.path / f"{name}.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", "-m", "enginecheck",
                                           "--enginecheck-checks=import,inspect", f"--enginecheck-json={report}",
                                           *args, timeout=300)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    return result, json.loads(report.read_text())


def test_a_second_run_over_the_zoo_is_all_hits(pytester: pytest.Pytester, cache_root: Path) -> None:
    first, report = run(pytester, "first")
    assert f"{CACHE}0 lookups answered from it (0 in memory, 0 on disk), 5 inspected the class (5 not cached yet), " \
           "0 found a corrupt entry" in said(first)
    assert report["cache"] == {"memory": 0, "disk": 0, "missing": BUNDLED, "source_changed": 0, "format_version": 0,
                               "no_source": 0, "corrupt": 0}
    second, report = run(pytester, "second")
    assert f"{CACHE}5 lookups answered from it (0 in memory, 5 on disk), 0 inspected the class, 0 found a corrupt " \
           "entry" in said(second)
    assert report["cache"]["disk"] == BUNDLED and sum(report["cache"].values()) == BUNDLED
    for r in report["results"]:
        # the child's start and answer are parts of "process"; payloads both ways are counted
        assert 0 < r["phases"]["process.start"] + r["phases"]["process.answer"] <= r["phases"]["process"]
        assert r["detail"]["payload_bytes"]["sent"] > 100 and r["detail"]["payload_bytes"]["received"] > 100
        assert ("cache" in r["detail"]) == (r["check"] == "inspect")  # the import check looks nothing up


def test_an_edited_model_reads_as_source_changed(pytester: pytest.Pytester, cache_root: Path) -> None:
    pytester.makepyfile(tiny_model=TINY_MODEL_CLASS.replace("TinyModel", "TinyForCausalLM"),
                        targets='MODELS = {"TinyForCausalLM": "tiny_model:TinyForCausalLM"}\n')
    pytester.makeini("[pytest]\npythonpath = .\n")
    target = "--enginecheck-target=targets:MODELS"
    first = said(run(pytester, "first", target)[0])
    assert "1 inspected the class (1 not cached yet), 0 found a corrupt entry" in first
    assert f"{CACHE}1 lookup answered from it (0 in memory, 1 on disk), 0 inspected the class" in said(
        run(pytester, "same", target)[0])
    model = pytester.path / "tiny_model.py"
    model.write_text(model.read_text() + "# an edit\n")
    edited, report = run(pytester, "edited", target)
    assert f"{CACHE}0 lookups answered from it (0 in memory, 0 on disk), 1 inspected the class (1 source changed), " \
           "0 found a corrupt entry" in said(edited)
    assert report["cache"]["source_changed"] == 1
