"""``python -m pytest_enginecheck.report merge``: duplicates and missing items called out, a single run's exit status,
bad shard files refused with the file and the fix named, a baseline's regressions printed. (The merge of a real split
run: test_sharding.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from pytest_enginecheck.merge import MergeError, expected_nodeids, merge
from pytest_enginecheck.report import write_json


def _result(arch: str, check: str, outcome: str, message: str = "", **detail: Any) -> dict[str, Any]:
    return {"arch": arch, "check": check, "outcome": outcome, "duration_s": 0.5, "phases": {"check": 0.4},
            "message": message, "detail": detail}


def _shard(path: Path, *results: dict[str, Any], target: str = "zoo.root_causes:REGISTRY") -> str:
    write_json(path, target, list(results))
    return str(path)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_enginecheck.report", "merge", *args], capture_output=True,
                          text=True, timeout=60)


def test_exit_status_is_a_single_runs(tmp_path: Path) -> None:
    passing = _shard(tmp_path / "a.json", _result("A", "import", "passed"), _result("A", "inspect", "skipped", "x"))
    failing = _shard(tmp_path / "b.json", _result("B", "load[tp=1]", "failed", "Loading B raised ValueError: no"))
    empty = _shard(tmp_path / "c.json")
    assert _cli(passing, empty, "--json", str(tmp_path / "m.json")).returncode == 0
    out = _cli(passing, failing, "--json", str(tmp_path / "m.json"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "2 architectures: 1 passed, 1 failed, 1 skipped" in out.stdout
    assert _cli(empty, "--json", str(tmp_path / "m.json")).returncode == 5  # pytest's "no tests collected"
    merged = json.loads((tmp_path / "m.json").read_text())
    assert (merged["version"], merged["target"], merged["results"]) == (1, "zoo.root_causes:REGISTRY", [])


def test_a_duplicate_is_called_out_and_the_worse_outcome_kept(tmp_path: Path) -> None:
    a = _shard(tmp_path / "a.json", _result("A", "import", "passed"))
    b = _shard(tmp_path / "b.json", _result("A", "import", "failed", "Importing a touched CUDA"))
    merged = merge([a, b])
    assert [r["outcome"] for r in merged.results] == ["failed"]
    assert merged.duplicates == {"enginecheck::A::import": [a, b]}
    assert merged.exit_status == 1
    out = _cli(a, b, "--json", str(tmp_path / "m.json"))
    assert f"duplicate: enginecheck::A::import was reported by 2 shards ({a}, {b})" in out.stdout


def test_missing_items_are_called_out_and_fail_the_merge(tmp_path: Path) -> None:
    """A root no shard reported (a shard file left out), and an item of the durations file no shard reported."""
    a = _shard(tmp_path / "a.json", _result("A", "import", "passed"),
               _result("B", "inspect", "skipped", "import failed, see enginecheck::B::import", kind="dependency",
                       root="enginecheck::B::import"))
    durations = tmp_path / ".test_durations"
    durations.write_text(json.dumps({"enginecheck::A::import": 0.1, "enginecheck::C::load[tp=2]@enginecheck-multirank":
                                     2.0, "tests/test_other.py::test_x": 0.1}))
    assert expected_nodeids(durations) == {"enginecheck::A::import", "enginecheck::C::load[tp=2]"}
    merged = merge([a], expected_nodeids(durations))
    assert merged.missing == ["enginecheck::B::import", "enginecheck::C::load[tp=2]"]
    assert merged.exit_status == 1
    out = _cli(a, "--json", str(tmp_path / "m.json"), "--junitxml", str(tmp_path / "m.xml"), "--expect", str(durations))
    assert out.returncode == 1
    assert "missing: enginecheck::B::import was reported by no shard" in out.stdout
    suite = ET.parse(tmp_path / "m.xml").getroot().find("testsuite")
    assert suite is not None and (suite.get("tests"), suite.get("errors"), suite.get("skipped")) == ("4", "2", "1")


@pytest.mark.parametrize(("content", "says"), [
    ("not json", "cannot read it as a JSON report"),
    (json.dumps({"version": 2, "target": "t", "results": []}), "not an --enginecheck-json report of version 1"),
    (json.dumps({"version": 1, "target": "t", "results": [{"arch": "A"}]}), "results[0] is not a check result"),
])
def test_a_bad_shard_file_is_refused_naming_it(tmp_path: Path, content: str, says: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(MergeError, match=r"bad\.json: ") as e:
        merge([bad])
    assert says in str(e.value)
    out = _cli(str(bad), "--json", str(tmp_path / "m.json"))
    assert (out.returncode, out.stdout) == (4, "")
    assert out.stderr.startswith(f"enginecheck merge: error: {bad}: {says}")
    assert not (tmp_path / "m.json").exists()


def test_shards_of_two_targets_are_refused(tmp_path: Path) -> None:
    a = _shard(tmp_path / "a.json", _result("A", "import", "passed"))
    b = _shard(tmp_path / "b.json", _result("A", "import", "passed"), target="vllm")
    with pytest.raises(MergeError, match=r"its target is 'vllm', the others' 'zoo\.root_causes:REGISTRY'"):
        merge([a, b])


def test_a_baseline_prints_the_regressions_and_the_page_lists_every_change(tmp_path: Path) -> None:
    old = _shard(tmp_path / "old.json", _result("A", "import", "passed"), _result("A", "inspect", "failed", "no"))
    new = _shard(tmp_path / "new.json", _result("A", "import", "failed", "Importing A touched CUDA"),
                 _result("A", "inspect", "passed"))
    out = _cli(new, "--json", str(tmp_path / "m.json"), "--html", str(tmp_path / "m.html"), "--baseline", old)
    assert out.returncode == 1, out.stdout + out.stderr  # a single run's status: the baseline does not change it
    assert f"since the baseline {old}: 1 regression, 1 improvement\n  regression: enginecheck::A::import: passed -> " \
           f"failed\nmerged 1 shard: 2 items of target 'zoo.root_causes:REGISTRY'; exit status 1\n" in out.stdout
    page = (tmp_path / "m.html").read_text()
    found = re.search(r'<script type="application/json" id="data">(.*?)</script>', page)
    assert found is not None, page[-2000:]
    data = json.loads(found[1])
    assert data["baseline"]["path"] == old
    assert [(c["kind"], c["item"]) for c in data["baseline"]["changes"]] == [
        ("regression", "enginecheck::A::import"), ("improvement", "enginecheck::A::inspect")]


@pytest.mark.parametrize(("content", "says"), [
    (None, "cannot read it as a JSON report"),
    ("[1, 2]", "not an --enginecheck-json report of version 1"),
    (json.dumps({"version": 1, "target": "vllm", "results": []}),
     "its target is 'vllm', the shards' 'zoo.root_causes:REGISTRY'; give an earlier report of the same"),
])
def test_a_baseline_that_is_not_a_report_of_the_target_is_refused_naming_it(tmp_path: Path, content: str | None,
                                                                            says: str) -> None:
    shard = _shard(tmp_path / "a.json", _result("A", "import", "passed"))
    bad = tmp_path / "old.json"
    if content is not None:
        bad.write_text(content)
    out = _cli(shard, "--json", str(tmp_path / "m.json"), "--baseline", str(bad))
    assert (out.returncode, out.stdout) == (4, ""), out.stderr
    assert out.stderr.startswith(f"enginecheck merge: error: --baseline {bad}: {says}"), out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "m.json").exists()
